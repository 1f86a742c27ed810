"""The epoch cursor: which epoch the loader is in, and where in its order (main process).

NOTE [ The epoch cursor ]

One object, ``EpochCursor``, owns everything that says where a loader is: the epoch, whether
it has started, where this iteration started in the epoch's order, the batches handed out
since, whether the epoch ran to its end, where the next iteration starts (a resume target),
and nothing else. Everything else reads it or calls one of its transitions:

- ``jump_to(epoch)`` — ``loader.set_epoch``: the next iteration is ``epoch``, from its start;
- ``resume_at(epoch, position)`` — ``load_state_dict``: the next iteration is ``epoch``, from
  ``position`` (in the unit of ``_resume.describe_order``);
- ``restart_at(position)`` — a ``Mix``'s weights changed mid-epoch: the current iteration
  goes on from ``position``, what was loaded ahead is loaded again (``DataLoader._mix_replan``);
- ``begin(requested)`` — ``iter(loader)``: move to the next epoch (or the user's
  ``sampler.set_epoch`` value, NOTE [ A user's set_epoch wins ] in samplers.py), take the
  resume target, and return (epoch, position) for the iterator;
- ``consumed_batch()`` and ``finished()`` — the iterator, as it hands out a batch (or its
  error) and when the epoch runs out;
- ``position(step, length)`` — ``state_dict``: where the next unseen sample is;
  ``next_unseen(step, length)`` — the same across epoch boundaries, for a ``Mix``'s weight
  change (``DataLoader._mix_next_position``, ``_mix_replan``).

It also keeps which indices each batch holds (NOTE [ Indices of a batch ]): ``due``, the
queue of the indices of tasks the schedule has handed out (schedule.py appends and, when it
starts an epoch again, clears them), and ``last``, the indices of the batch handed out last,
moved from the queue by ``consumed_batch``.

The seed has one owner too: the loader's ``seed`` attribute (a plain attribute, as every
argument of the constructor is, so that Lightning rebuilds the loader with it). Only
``load_state_dict`` changes it, and hands the order's seed to the samplers that draw from one
(``DataLoader._seed_samplers``) in the same call; an iterator takes the seed once, when its
workers start, and ``load_state_dict`` restarts them.

The loader's public ``epoch`` attribute is a property over this object.
"""

from __future__ import annotations

from collections import deque
from typing import Any

# NOTE [ Indices of a batch ]
#
# ``loader.last_indices`` says which samples the batch just handed out holds, read in the main
# process from the order itself, never sent by workers: every task the schedule hands out
# (schedule.py: ``next_task``, one task per batch, the batches of a group each their own)
# puts its indices on the cursor's ``due`` queue, and each batch handed out (or raised in its
# place, ``consumed_batch``) takes the oldest. Batches reach the training loop in the order
# their tasks were handed out, whichever worker loaded them, whether they travelled several to
# a message, were loaded again after a worker's death, or were copied to the device ahead:
# so the two queues stay in step. Whatever breaks that order restarts the schedule, which
# clears ``due``: an epoch begun anew or at a resume position, a drain after an early break,
# a Mix's weight change. Two cases have no such order, and the loader refuses them by name:
# ``in_order=False`` with workers (batches handed out as they finish) and iterable datasets
# (no indices). With ``distributed=True`` the indices are this rank's.


class EpochCursor:
    """Where a loader is: epoch, started/complete, position in the order, resume target.

    Attributes (read them; change them only through the methods):
        epoch: the current epoch (the next one to run, until it has started).
        started: whether ``epoch`` has started (else it is the next one).
        complete: whether the current iteration ran to the end of ``epoch``.
        start: where the current iteration started in ``epoch``'s order.
        consumed: batches handed out (or raised in their place) by the current iteration.
        target: where the next iteration starts, if it is ``epoch``.
    """

    __slots__ = ("epoch", "started", "complete", "start", "consumed", "target", "due", "last")

    def __init__(self) -> None:
        self.epoch = 0
        self.started = False
        self.complete = False
        self.start = 0
        self.consumed = 0
        self.target = 0
        self.due: deque = deque()  # indices of the tasks handed out, not yet consumed
        self.last: Any = None  # the indices of the batch handed out last

    def jump_to(self, epoch: int) -> None:
        """The next iteration is ``epoch``, from its start (``loader.set_epoch``)."""
        self.epoch = epoch
        self.started = False
        self.target = 0

    def resume_at(self, epoch: int, position: int) -> None:
        """The next iteration is ``epoch`` from ``position`` (a loaded state)."""
        self.epoch = epoch
        self.started = False
        self.complete = False
        self.target = position
        self.start = position
        self.consumed = 0

    def begin(self, requested: int | None = None) -> tuple[int, int]:
        """Start an iteration: the epoch after a started one (or ``requested``, the user's
        ``sampler.set_epoch`` value, when it differs), from the resume target or its start.

        Returns:
            (epoch, position in its order) for the iterator.
        """
        if self.started:
            self.epoch += 1
            self.target = 0
        if requested is not None and requested != self.epoch:
            self.epoch = requested  # the user's own counter wins
            self.target = 0
        position, self.target = self.target, 0
        self.last = None
        self.started = True
        self.start = position
        self.consumed = 0
        self.complete = False
        return self.epoch, position

    def restart_at(self, position: int) -> None:
        """The current iteration goes on from ``position`` of its epoch (a ``Mix``'s weights
        changed: what was loaded ahead is loaded again, NOTE [ Weight changes ])."""
        self.start = position
        self.consumed = 0

    def consumed_batch(self) -> None:
        """A batch (or the error raised in its place) was handed out."""
        self.consumed += 1
        due = self.due
        self.last = due.popleft() if due else None

    def finished(self) -> None:
        """The current iteration ran to the end of its epoch."""
        self.complete = True

    def position(self, step: int, length: int | None) -> int:
        """Where the next unseen item of the epoch is: ``step`` items per batch consumed,
        capped at the epoch's ``length`` when known; 0 before the epoch has started."""
        if not self.started:
            return 0
        position = self.start + self.consumed * step
        return position if length is None else min(position, length)

    def next_unseen(self, step: int, length: int | None) -> tuple[int, int, bool]:
        """(epoch, position in it, whether an iteration is in its middle) of the next item the
        training loop has not seen, as ``position`` counts, across epoch boundaries."""
        if not self.started:
            return self.epoch, self.target, False
        if self.complete:
            return self.epoch + 1, 0, False
        return self.epoch, self.position(step, length), True
