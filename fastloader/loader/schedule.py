"""The cross-epoch schedule: which task (epoch + indices) workers load next (main process).

Plain Python over a sampler's public interface (``iter``, ``set_epoch`` through a callback,
``iter_from`` where a sampler has it): no torch internals, so it is tested on its own
(tests/test_schedule.py). The iterators in loader/iterators/ draw their tasks from it.

NOTE [ Cross-epoch prefetch ]

torch's persistent workers idle at every epoch boundary: the sampler of epoch e is exhausted,
the last batches are consumed, and only the next ``__iter__`` primes the workers again, so the
first batch of every epoch waits for a full batch load. Here indices come from an
``EpochSchedule`` that, when the order of the next epoch is already determined (our seeded
shuffle sampler, a sequential sampler, anything with ``set_epoch`` such as DistributedSampler),
carries on into epoch e+1 as soon as epoch e's indices run out: workers keep loading. Every
task carries its epoch (NOTE [ Seeding contract ]), so a batch is identical whether it was
loaded early or not. The schedule looks one batch ahead, so the length of an epoch is known
before its last batch is consumed; ``_next_data`` stops there. If the next iteration is not the
epoch that was prefetched (the loop broke out early, ``set_epoch`` jumped, a state was
loaded), the prefetched batches are drained with torch's own reset and loading restarts. Tasks
go one epoch ahead at most (``next_task(last_epoch=)``): with more batches in flight than an
epoch has (NOTE [ Prefetch depth by batch bytes ]), going further would be drained and loaded
again at every epoch's start.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import BatchSampler

from fastloader.loader.seeding import Task

__all__ = ["EpochSchedule", "indices_from"]

_END = object()


def indices_from(index_sampler: Any, batched: bool, skip: int) -> Iterator[Any]:
    """The index sampler's items of the current epoch, from position ``skip`` on.

    ``skip`` counts samples of the sampler's order (global samples for
    ``ElasticDistributedSampler``), except for a batch sampler of the user's, whose batches
    cannot be re-cut: there it counts batches. See NOTE [ Resume is exact or refused ].
    """
    if skip == 0:
        return iter(index_sampler)
    custom_batches = batched and type(index_sampler) is not BatchSampler
    if custom_batches:
        return itertools.islice(iter(index_sampler), skip, None)
    sampler = index_sampler.sampler if batched else index_sampler
    if callable(getattr(sampler, "iter_from", None)):
        stream = sampler.iter_from(skip)
    else:
        stream = itertools.islice(iter(sampler), skip, None)
    if not batched:
        return stream
    return iter(BatchSampler(stream, index_sampler.batch_size, index_sampler.drop_last))


class EpochSchedule:
    """Hands out ``Task``s (epoch + indices) one epoch after another, one task ahead.

    ``start(epoch, skip)`` begins ``epoch`` at position ``skip`` of its order: samples (global
    samples with ``distributed=True``), or batches for a user's batch sampler (see
    ``indices_from``). ``lengths[e]`` is where a consumer's count of delivered tasks ends
    epoch ``e`` when it counts from ``skip`` for the started epoch (and from 0 for the epochs
    after it): ``skip`` plus the number of tasks of the epoch sent from there.

    Each task's indices also go on ``due`` (the loader's cursor's queue: NOTE [ Indices of a
    batch ] in loader/cursor.py), which ``start`` clears.

    It holds no reference to the loader, so a loader and its workers can be collected.
    """

    def __init__(
        self,
        index_sampler: Any,
        set_epoch: Callable[[int], None],
        may_cross: bool,
        batched: bool = True,
        due: deque | None = None,
    ):
        self.due = deque() if due is None else due
        self._index_sampler = index_sampler
        self._set_epoch = set_epoch
        self._batched = batched
        self.may_cross = may_cross
        self.lengths: dict[int, int] = {}  # epoch -> where its count of tasks ends, once known
        self.epoch = -1  # the epoch tasks are being sent for
        self._indices: Iterator[Any] = iter(())
        self._next: Any = _END
        self._sent = 0

    def start(self, epoch: int, skip: int = 0) -> None:
        """Send tasks of ``epoch`` from position ``skip`` on, dropping anything pending."""
        self.due.clear()
        self._open(epoch, skip)

    def _open(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self._sent = skip
        self.lengths.pop(epoch, None)
        self._set_epoch(epoch)
        self._indices = indices_from(self._index_sampler, self._batched, skip)
        self._next = next(self._indices, _END)
        if self._next is _END:
            self.lengths[epoch] = skip

    def _advance(self) -> Any:
        current = self._next
        self._sent += 1
        self._next = next(self._indices, _END)
        if self._next is _END:
            self.lengths[self.epoch] = self._sent
        return current

    def finish_epoch(self) -> None:
        """Count the current epoch's tasks left unsent, so that its ``lengths`` is known."""
        while self._next is not _END:
            self._advance()

    def more_in(self, epoch: int) -> bool:
        """Whether ``epoch`` is the epoch being sent and has a task left."""
        return self.epoch == epoch and self._next is not _END

    def next_task(self, number: int = -1, last_epoch: int | None = None) -> Task:
        """The next task to send (as torch's task ``number``), of ``last_epoch`` at the latest.
        Raises StopIteration when nothing may be sent now."""
        if self._next is _END:
            if not self.may_cross or self.epoch < 0:
                raise StopIteration
            if last_epoch is not None and self.epoch >= last_epoch:
                raise StopIteration  # sent later, once the consumer is in the next epoch
            self._open(self.epoch + 1)
            if self._next is _END:
                raise StopIteration
        indices = self._advance()
        self.due.append(indices)
        return Task(self.epoch, indices, number)
