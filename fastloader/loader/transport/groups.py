"""Several consecutive batches in one task and one result message, for cheap batches.

Both sides: the pool (main process) sends a ``TaskGroup``, the worker's seeded dataset loads it
into a ``LoadedGroup``, ``SlotCollate`` writes every batch of it into one slot region and the
main process receives ``Batches``, handed out one by one.

NOTE [ Batches per message ]

With cheap samples the cost of a batch is its message, not its data (issue 30: a batch of 64
pose records loads in ~100 us; sending its task and receiving its result cost the main process
~60 us and the worker as much, on top of torch's per-batch loop). Bigger messages amortise
that: 2 workers delivered 1.4x fastloader's in-process rate at batch 256 but 0.8x at batch 64.
So once a pool sees that batches arrive quickly, it sends several consecutive batches of an
epoch as one task (pose batches of 64 with 2 workers: 1.06-1.17x the in-process rate in 3 of
4 runs, 0.88x in one, and 0.04 ms of the main process's CPU per batch instead of 0.10;
benchmarks/results/transport-groups-full.md):

* **When.** Only with the slot transport, a map-style dataset with batches (``batch_size`` or a
  batch sampler), a collate that draws nothing (the default, or a ``Mix``'s over it:
  ``collate_draws_nothing`` in loader/seeding.py; so collating after the group's last
  batch is loaded gives each batch what it gave alone), and the prefetch depth left to
  fastloader (a ``prefetch_factor`` the user gives counts batches in flight, as with torch).
  A pool starts with one batch per message. In every epoch of at least ``DECIDE_AT``
  batches, the main process times the delivery from the ``DECIDE_FROM``-th batch to the
  ``DECIDE_AT``-th (the training loop's own time included), and ``group_size`` then makes each
  message carry about ``MESSAGE_S`` of the workers' time (at most ``MAX_GROUP`` batches) for
  the tasks sent after it (decided again each epoch: the first epoch's timing includes cold
  pages and start-up). Batches that take longer (images), a training loop slower than the
  loader (a GPU step) and pools whose epochs are all shorter stay one batch per message.
  Groups never cross an epoch.
* **Memory.** A group's batches share one slot region, and a region holds at most
  ``GROUP_BYTES`` of batches (or one batch, where one alone is bigger), whatever the batches
  become. The size follows the bytes of the batches actually sent: it is decided from the
  bytes of the deciding batch, and every group received sizes the groups sent after it
  (``GroupPlan.fit``, from the region's bytes per batch), up to the size the timing chose.
  Groups already sent when batches grow are cut by the worker, by the bytes it collated, into
  several regions of at most ``GROUP_BYTES`` sent as one message (``Parts``). Sized on the
  first batch instead, batches that grew over an epoch travelled 16 to a 58 MB region and
  held 297 MB per worker (issue 39); now 8 MB regions and 31 MB (tests/test_transport_round4.py).
  The messages in flight per worker are the batch depth divided by the group size, at least
  2: at most two groups or the depth plus one group, within the ``PREFETCH_BYTES`` that NOTE
  [ Prefetch depth by batch bytes ] allows. So slot memory per worker stays within the
  messages in flight plus three regions (the one being written, and the two whose batches
  the training loop holds as it moves from one group to the next), each ``GROUP_BYTES`` and
  an eighth to grow, while batches are below ``GROUP_BYTES``. A batch the user keeps holds
  its group's region until every batch of the group is dropped.
* **Timeouts.** ``timeout=`` is torch's wait for one batch. A message of 16 batches of 0.3 s
  takes 4.8 s, so the main process does not time the message: while it waits, it watches the
  progress of the worker holding the awaited task (its task number and the batch of its group
  it loads, the shared slots supervision keeps) and starts the wait again whenever that moves.
  A batch stuck longer than ``timeout`` raises the timeout error, naming the batch of the
  group being loaded; batches that each beat it never do. Without supervision (a benchmark
  switch) the wait is the timeout times the batches in the awaited message.
* **Failures.** Each batch of a group fails alone: an error loading or collating it is that
  batch's result, raised in its place; the group's other batches arrive. A worker killed
  while loading a group is healed as for one batch (NOTE [ Supervised workers ]): the group is
  sent again. Each worker also records which batch of its group it is loading (a second
  shared progress slot), so deaths are blamed on that batch: once it has killed workers
  ``POISON_DEATHS`` times, the group is sent again with that batch *skipped*, its poison
  error (naming that batch's indices) carried in the task and handed out in its place, and
  the group's other batches arrive. A worker that dies past the group's loads (collating,
  writing the slot) is blamed on the group: once poison, every batch of it raises. After a
  death, the pool goes back to one batch per message.
* **Counting.** Epoch lengths, ``state_dict`` positions and the diagnosis count batches, as
  before: a group is only how batches travel.
"""

from __future__ import annotations

from collections import deque
from time import perf_counter
from typing import Any, NamedTuple

from torch._utils import ExceptionWrapper

DECIDE_FROM = 16  # batches of an epoch before timing starts (start-up, first reads)
DECIDE_AT = 48  # the batch of an epoch at which the group size is decided
MESSAGE_S = 0.004  # workers' time one message should carry
#: pose batches of 64, 2 workers, against the in-process rate (interleaved, 2 runs each): groups
#: of 2 gave 0.86-0.88x, 8 1.05-1.20x, 16 1.24-1.39x, 24 1.14-1.31x
MAX_GROUP = 16
GROUP_BYTES = 8 << 20  # the batches of one region together: a quarter of PREFETCH_BYTES


class TaskGroup(NamedTuple):
    """Consecutive batches of one epoch sent to a worker as one task."""

    epoch: int
    batches: tuple  # each batch's indices, in order
    number: int = -1  # torch's task number, as in ``Task``
    skipped: tuple = ()  # (position, its result): batches judged poison, not loaded again

    @property
    def indices(self) -> list:
        """Every index of the group, in order (what an error about the whole group names)."""
        return [index for batch in self.batches for index in batch]


class LoadedGroup(list):
    """In the worker: each batch's samples, or the ``ExceptionWrapper`` of a batch that
    failed to load, in order (what the seeded dataset returns for a ``TaskGroup``)."""

    __slots__ = ()


class Batches(list):
    """A group's results, in order: each a batch, or the ``ExceptionWrapper`` of a batch
    that failed (what the main process receives for a ``TaskGroup``). ``nbytes``: in the
    main process, the bytes of the slot region they came in."""

    nbytes = 0


class Parts(list):
    """A group whose batches grew past ``GROUP_BYTES`` since it was sized: its batches in
    several regions, each part a ``Batches`` once received (see the NOTE, "Memory")."""

    __slots__ = ()

    def joined(self) -> Batches:
        """The parts' batches as one ``Batches`` (in the main process)."""
        joined = Batches(item for part in self for item in part)
        joined.nbytes = sum(part.nbytes for part in self)
        return joined


def batch_error(worker_id: int) -> ExceptionWrapper:
    """The exception being handled, as one batch's result: what torch's worker loop makes of
    a task's exception, for one batch of a group."""
    return ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")


def group_size(seconds_per_batch: float, workers: int) -> int:
    """How many batches a message should carry when the pool delivers one batch every
    ``seconds_per_batch`` with ``workers`` workers (each worker then takes about
    ``seconds_per_batch * workers`` per batch)."""
    worker_s = max(seconds_per_batch * workers, 1e-9)
    return max(1, min(MAX_GROUP, int(MESSAGE_S / worker_s)))


class GroupPlan:
    """The pool's side: whether and how many batches go per message, and the received batches
    of a group not yet handed out (NOTE [ Batches per message ])."""

    def __init__(self, allowed: bool) -> None:
        self.adapts = allowed  # the size follows each epoch's timing (until a death)
        self.size = 1
        self.timed = 1  # the size the timing chose; ``size`` is at most what bytes allow
        self.pending: deque = deque()  # batches (or ExceptionWrappers) still to hand out
        self._counted = 0
        self._started = 0.0

    def new_epoch(self) -> None:
        """Drop what an abandoned epoch left; timing starts again with the epoch."""
        self.pending.clear()
        self._counted = 0

    def count(self) -> bool:
        """Count one batch handed out; True when it is the batch that decides the size."""
        self._counted += 1
        if self._counted == DECIDE_FROM:
            self._started = perf_counter()
        return self._counted == DECIDE_AT

    def decide(self, workers: int, batch_bytes: int) -> None:
        """Size messages from the timing since ``DECIDE_FROM`` and the bytes of the batch
        just handed out (``count`` said when)."""
        per_batch = (perf_counter() - self._started) / (DECIDE_AT - DECIDE_FROM)
        self.timed = group_size(per_batch, workers)
        self.fit(batch_bytes)

    def fit(self, batch_bytes: int) -> bool:
        """Size messages for batches of ``batch_bytes`` (the latest received): at most the
        timed size, within ``GROUP_BYTES``. True when the size changed."""
        fit = GROUP_BYTES // batch_bytes if batch_bytes else MAX_GROUP
        size = max(1, min(self.timed, fit))
        changed = size != self.size
        self.size = size
        return changed

    def stop(self) -> None:
        """One batch per message from now on (after a worker's death)."""
        self.adapts = False
        self.size = self.timed = 1

    def grow(self, first: Any, schedule: Any, number: int) -> Any:
        """``first`` (a ``Task``) and the epoch's next batches as one ``TaskGroup`` of up to
        ``size`` batches; ``first`` itself when no other batch of its epoch is left."""
        batches = [first.indices]
        while len(batches) < self.size and schedule.more_in(first.epoch):
            batches.append(schedule.next_task(number).indices)
        if len(batches) == 1:
            return first
        return TaskGroup(first.epoch, tuple(batches), number)
