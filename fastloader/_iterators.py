"""Iterator subclasses of torch's: kept alive across epochs, cross-epoch prefetch, resume.

Everything here runs in the main process, except what torch's worker loop runs with the
objects built here (the seeded dataset wrappers and ``_WorkerInit``).

NOTE [ torch internals fastloader relies on ]

Every touch of torch's private DataLoader machinery is in this module. Tested with torch
2.13.0 and 2.14.1 (the range pinned in pyproject.toml). We subclass
``_SingleProcessDataLoaderIter`` and ``_MultiProcessingDataLoaderIter`` and rely on:

- ``_BaseDataLoaderIter.__init__`` assigning ``self._dataset`` and the multiprocessing
  iterator reading ``self._worker_init_fn`` before it starts workers: both are properties here,
  so workers receive the seeded wrapper and fastloader's init function;
- ``_next_index()`` being the only place indices are drawn (``_try_put_index`` treats its
  StopIteration as "nothing to send now");
- ``_next_data()``, ``_reset(loader)``, ``_try_put_index()``, ``_shutdown_workers()`` and the
  counters ``_send_idx``, ``_rcvd_idx``, ``_task_info``, ``_tasks_outstanding``,
  ``_prefetch_factor``, ``_in_order``;
- ``torch.utils.data._utils.worker.WorkerInfo`` being a plain object whose ``dataset`` we
  point back at the user's dataset.

NOTE [ Cross-epoch prefetch ]

torch's persistent workers idle at every epoch boundary: the sampler of epoch e is exhausted,
the last batches are consumed, and only the next ``__iter__`` primes the workers again, so the
first batch of every epoch waits for a full batch load. Here indices come from an
``_EpochSchedule`` that, when the order of the next epoch is already determined (our seeded
shuffle sampler, a sequential sampler, anything with ``set_epoch`` such as DistributedSampler),
carries on into epoch e+1 as soon as epoch e's indices run out: workers keep loading. Every
task carries its epoch (NOTE [ Seeding contract ]), so a batch is identical whether it was
loaded early or not. The schedule looks one batch ahead, so the length of an epoch is known
before its last batch is consumed; ``_next_data`` stops there. If the next iteration is not the
epoch that was prefetched (the loop broke out early, ``set_epoch`` jumped, a state was
loaded), the prefetched batches are drained with torch's own reset and loading restarts.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler, get_worker_info
from torch.utils.data.dataloader import (
    _DatasetKind,
    _MultiProcessingDataLoaderIter,
    _SingleProcessDataLoaderIter,
)

from fastloader.samplers import (
    EpochShuffleSampler,
    samplers_with_set_epoch,
    set_epoch_unrecorded,
)
from fastloader.seeding import RNGStateSwap, SeededDataset, SeededIterableDataset, Task

_END = object()


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler and batch sampler that have it.

    The calls are the loader's own: they are not taken as a user's request (see NOTE [ A
    user's set_epoch wins ] in ``samplers.py``).
    """
    for sampler in samplers_with_set_epoch(loader):
        set_epoch_unrecorded(sampler, epoch)


def order_is_predictable(loader: Any) -> bool:
    """Whether the index order of a future epoch can be drawn now without changing it."""
    if loader._dataset_kind != _DatasetKind.Map or not loader.in_order:
        return False
    sampler = loader._index_sampler
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    if isinstance(sampler, (SequentialSampler, EpochShuffleSampler, DistributedSampler)):
        return True
    if isinstance(sampler, (list, tuple, range)):
        return True
    return callable(getattr(sampler, "set_epoch", None))


def _indices_from(index_sampler: Any, batched: bool, skip: int) -> Iterator[Any]:
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


class _EpochSchedule:
    """Hands out ``Task``s (epoch + indices) one epoch after another, one task ahead.

    ``start(epoch, skip)`` begins ``epoch`` at position ``skip`` of its order: samples (global
    samples with ``distributed=True``), or batches for a user's batch sampler (see
    ``_indices_from``). ``lengths[e]`` is where a consumer's count of delivered tasks ends
    epoch ``e`` when it counts from ``skip`` for the started epoch (and from 0 for the epochs
    after it): ``skip`` plus the number of tasks of the epoch sent from there.

    It holds no reference to the loader, so a loader and its workers can be collected.
    """

    def __init__(
        self,
        index_sampler: Any,
        set_epoch: Callable[[int], None],
        may_cross: bool,
        batched: bool = True,
    ):
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
        self._open(epoch, skip)

    def _open(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self._sent = skip
        self.lengths.pop(epoch, None)
        self._set_epoch(epoch)
        self._indices = _indices_from(self._index_sampler, self._batched, skip)
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

    def next_task(self) -> Task:
        """The next task to send. Raises StopIteration when nothing may be sent now."""
        if self._next is _END:
            if not self.may_cross or self.epoch < 0:
                raise StopIteration
            self._open(self.epoch + 1)
            if self._next is _END:
                raise StopIteration
        return Task(self.epoch, self._advance())


def _schedule_for(loader: Any, may_cross: bool) -> _EpochSchedule:
    def set_epoch(epoch: int) -> None:
        for sampler in samplers:
            set_epoch_unrecorded(sampler, epoch)

    samplers = samplers_with_set_epoch(loader)
    batched = loader.batch_sampler is not None
    return _EpochSchedule(loader._index_sampler, set_epoch, may_cross, batched)


class _WorkerInit:
    """Runs in each worker before the user's ``worker_init_fn``.

    Points ``get_worker_info().dataset`` back at the user's dataset, so code that configures
    the dataset per worker (sharding an iterable dataset, opening files) sees its own object.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if isinstance(info.dataset, (SeededDataset, SeededIterableDataset)):
            object.__setattr__(info, "dataset", info.dataset.dataset)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _SeededDatasetMixin:
    """Swaps in the seeded dataset wrapper where torch's iterator stores the dataset."""

    _seed: int
    _shared_epoch: Any

    @property
    def _dataset(self) -> Any:
        return self.__dict__["_seeded_dataset"]

    @_dataset.setter
    def _dataset(self, dataset: Any) -> None:
        if isinstance(dataset, (SeededDataset, SeededIterableDataset)):
            wrapped = dataset
        elif self._schedule is None:
            wrapped = SeededIterableDataset(dataset, self._seed, self._shared_epoch)
        else:
            wrapped = SeededDataset(dataset, self._seed)
        self.__dict__["_seeded_dataset"] = wrapped

    def _next_index(self) -> Any:
        if self._schedule is None:
            return super()._next_index()
        return self._schedule.next_task()


class SingleProcessIter(_SeededDatasetMixin, _SingleProcessDataLoaderIter):
    """One epoch loaded in the main process, without disturbing the training loop's RNGs."""

    def __init__(self, loader: Any, epoch: int, skip: int = 0) -> None:
        self._seed = loader.seed
        self._shared_epoch = multiprocessing.RawValue("q", epoch)
        self._schedule = None
        if loader._dataset_kind == _DatasetKind.Map:
            self._schedule = _schedule_for(loader, may_cross=False)
            self._schedule.start(epoch, skip)
        self._rng_swap = RNGStateSwap()
        super().__init__(loader)

    def _next_data(self) -> Any:
        with self._rng_swap:
            return super()._next_data()


class WorkerPoolIter(_SeededDatasetMixin, _MultiProcessingDataLoaderIter):
    """Worker processes that serve epoch after epoch. See NOTE [ Cross-epoch prefetch ]."""

    def __init__(self, loader: Any, epoch: int, skip: int = 0) -> None:
        self._seed = loader.seed
        context = loader.multiprocessing_context or multiprocessing.get_context()
        self._shared_epoch = context.RawValue("q", epoch)
        self._schedule = None
        if loader._dataset_kind == _DatasetKind.Map:
            may_cross = loader.persistent_workers and order_is_predictable(loader)
            self._schedule = _schedule_for(loader, may_cross)
            self._schedule.start(epoch, skip)
        self._epoch = epoch
        self._delivered = skip
        self._epoch_done = False
        started = time.perf_counter()
        super().__init__(loader)
        self.startup_s = time.perf_counter() - started

    @property
    def _worker_init_fn(self) -> _WorkerInit:
        return self.__dict__["_fastloader_worker_init"]

    @_worker_init_fn.setter
    def _worker_init_fn(self, user_fn: Callable[[int], None] | None) -> None:
        if not isinstance(user_fn, _WorkerInit):
            user_fn = _WorkerInit(user_fn)
        self.__dict__["_fastloader_worker_init"] = user_fn

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the worker processes."""
        return [w.pid for w in self._workers]

    def begin_epoch(self, loader: Any, epoch: int, skip: int = 0) -> None:
        """Serve ``epoch`` next, from its ``skip``-th batch on."""
        if self._schedule is None:  # iterable dataset: torch's reset, with the new epoch
            self._shared_epoch.value = epoch
            self._reset(loader)
        elif self._continues_into(epoch, skip):
            self._fill()
        elif self._tasks_outstanding == 0 and not self._task_info:
            self._schedule.start(epoch, skip)
            self._fill()
        else:  # stale batches in flight: drain them with torch's reset, then restart
            self._schedule.start(epoch, skip)
            self._reset(loader)
        self._epoch = epoch
        self._delivered = skip
        self._epoch_done = False

    def _continues_into(self, epoch: int, skip: int) -> bool:
        # True when the tasks in flight are exactly epoch `epoch` from its first batch on.
        return (
            skip == 0
            and self._schedule.epoch == epoch == self._epoch + 1
            and self._delivered == self._schedule.lengths.get(self._epoch)
        )

    def _fill(self) -> None:
        # Tasks sent but not yet returned, including results that arrived out of order: torch
        # sends a new task only when one is returned, so this stays within its limit.
        limit = self._prefetch_factor * self._num_workers
        while self._send_idx - self._rcvd_idx < limit:
            sent = self._send_idx
            self._try_put_index()
            if self._send_idx == sent:
                break

    def _next_data(self) -> Any:
        if self._schedule is not None:
            length = self._schedule.lengths.get(self._epoch)
            if self._epoch_done or (length is not None and self._delivered >= length):
                self._epoch_done = True
                raise StopIteration
        try:
            data = super()._next_data()
        except StopIteration:
            self._epoch_done = True
            raise
        self._delivered += 1
        return data

    def shutdown(self) -> None:
        """Stop the worker processes now."""
        self._shutdown_workers()
