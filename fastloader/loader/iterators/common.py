"""What both of fastloader's iterators add to torch's, and the single-process iterator.

Runs in the main process. See NOTE [ torch internals fastloader relies on ] in __init__.py.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterDataPipe,
    SequentialSampler,
)
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _SingleProcessDataLoaderIter,
)

from fastloader.datasets.collate import PILImagesError
from fastloader.loader.schedule import EpochSchedule
from fastloader.loader.seeding import (
    RNGStateSwap,
    SeededDataset,
    SeededIterableDataset,
    seeding_options,
)
from fastloader.loader.setup_warnings import warn_if_empty_epoch
from fastloader.sampling.samplers import (
    EpochShuffleSampler,
    samplers_with_set_epoch,
    set_epoch_unrecorded,
)


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


def schedule_for(loader: Any, may_cross: bool) -> EpochSchedule:
    def set_epoch(epoch: int) -> None:
        for sampler in samplers:
            set_epoch_unrecorded(sampler, epoch)

    samplers = samplers_with_set_epoch(loader)
    batched = loader.batch_sampler is not None
    due = loader._cursor.due  # NOTE [ Indices of a batch ] in loader/cursor.py
    return EpochSchedule(loader._index_sampler, set_epoch, may_cross, batched, due)


class SeededDatasetMixin:
    """Swaps in the seeded dataset wrapper where torch's iterator stores the dataset."""

    _seed: int  # the loader's seed when this iterator (and its workers) started
    _seeding: dict = {}  # seeding_options(loader) (NOTE [ Lazy seeding ] in loader/lazy_seeding.py)
    busy_seconds: Any = None  # per worker, seconds loading (NOTE [ The diagnosis ])
    _cursor: Any  # the loader's EpochCursor (NOTE [ The epoch cursor ] in loader/cursor.py)
    _shared_epoch: Any
    _progress: Any = None
    _group_progress: Any = None  # NOTE [ Batches per message ]

    @property
    def _dataset(self) -> Any:
        return self.__dict__["_seeded_dataset"]

    @_dataset.setter
    def _dataset(self, dataset: Any) -> None:
        if isinstance(dataset, (SeededDataset, SeededIterableDataset)):
            wrapped = dataset
        elif self._schedule is None and isinstance(dataset, IterDataPipe):
            # torch shards and seeds a DataPipe itself, by its type: left unwrapped, it keeps
            # torch's behaviour (a wrapper hid it, and every worker yielded every element)
            wrapped = dataset
        elif self._schedule is None:
            seed_rngs = self._seeding.get("seed_rngs", "auto")
            wrapped = SeededIterableDataset(dataset, self._seed, self._shared_epoch, seed_rngs)
        else:
            wrapped = SeededDataset(
                dataset,
                self._seed,
                self._progress,
                busy=self.busy_seconds,
                group_progress=self._group_progress,
                **self._seeding,
            )
        self.__dict__["_seeded_dataset"] = wrapped

    def _next_index(self) -> Any:
        if self._schedule is None:
            return super()._next_index()
        return self._schedule.next_task()


class LoaderIterMixin:
    """Makes torch's iterator what ``iter(loader)`` returns, adding the loader's bookkeeping.

    ``__next__`` is torch's (profiler label, ``_num_yielded``, the IterableDataset length
    warning) plus loading-time stats, the epoch cursor's count of consumed batches (a batch
    whose loading raised counts too, as it does toward the end of the epoch) and, with
    ``device``, the copy to the device ahead of use. The loader is held weakly: dropping the
    loader or this iterator stops the workers as with torch.
    """

    _delivered: int  # batches of this epoch handed on (or raised), counted by each iterator
    _interrupted = False
    _source_s = 0.0  # seconds in _TorchNext during the current next() (device copies only)

    def _bind(self, loader: Any) -> None:
        self._loader_ref = weakref.ref(loader)
        self._user_dataset = loader.dataset  # (torch's _dataset is the seeding wrapper)
        self._cursor = loader._cursor
        self._stats = loader.stats
        self._device_batches = None
        if loader._resolved_device is not None:
            from fastloader.device import DevicePrefetcher

            # source failures torch counted as a delivered batch, raised later in their place
            self._counted_failures: list[BaseException] = []
            prefetcher = DevicePrefetcher(
                _TorchNext(self),
                loader._resolved_device,
                depth=loader.device_prefetch,
                transform=loader.device_transform,
            )
            self._device_batches = iter(prefetcher)

    def __next__(self) -> Any:
        started = time.perf_counter()
        delivered = self._delivered
        try:
            if self._device_batches is None:
                batch = torch_next(self)
            else:
                self._source_s = 0.0  # time in _TorchNext: waiting for loading, not the copy
                batch = next(self._device_batches)
        except StopIteration:
            self._cursor.finished()
            cursor, loader = self._cursor, self._loader_ref()
            if loader is not None and not cursor.consumed:  # NOTE [ Empty epochs ]
                warn_if_empty_epoch(loader, 0, resumed_at_end=cursor.start > 0)
            self._stats.end_epoch(time.perf_counter() - started)
            raise
        except KeyboardInterrupt:
            self._interrupted = True
            raise
        except Exception as error:
            if isinstance(error, PILImagesError):  # NOTE [ Advice that fits the dataset ]
                error.for_dataset(self._user_dataset)
            if self._device_batches is None:
                counted = self._delivered != delivered
            else:  # the prefetcher raises a failure after the batches pulled before it
                counted = _take(self._counted_failures, error)
            if counted:
                self._cursor.consumed_batch()
            raise
        now = time.perf_counter()
        device_s = 0.0 if self._device_batches is None else now - started - self._source_s
        self._stats.record_batch(now - started, batch, now, max(0.0, device_s))
        self._cursor.consumed_batch()
        return batch


# NOTE [ The profiler label ]
#
# torch's ``_BaseDataLoaderIter.__next__`` opens a ``record_function`` span around every
# batch, whether or not a profiler runs: about 6 us a batch (2-core box), as much as the whole
# bookkeeping of a batch of cheap samples loaded in the main process (issue 30). For
# map-style datasets, with no profiler on, ``torch_next`` runs the rest of that method as it
# is (reset on first use, ``_next_data``, ``_num_yielded``); with a profiler on, or for
# iterable datasets (whose length warning lives there), it calls torch's own.
_profiler_enabled = torch._C._autograd._profiler_enabled


def torch_next(iterator: Any) -> Any:
    """torch's ``__next__`` of ``iterator``, without the profiler label when no profiler
    runs (NOTE [ The profiler label ])."""
    if iterator._schedule is None or _profiler_enabled():
        return _BaseDataLoaderIter.__next__(iterator)
    if iterator._sampler_iter is None:
        iterator._reset()
    data = iterator._next_data()
    iterator._num_yielded += 1
    return data


class _TorchNext:
    """torch's ``__next__`` of an iterator, as an iterable for the device prefetcher."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = weakref.proxy(iterator)

    def __iter__(self) -> _TorchNext:
        return self

    def __next__(self) -> Any:
        iterator = self._iterator
        delivered = iterator._delivered
        started = time.perf_counter()
        try:
            return torch_next(iterator)
        except Exception as error:
            if iterator._delivered != delivered:  # a batch whose loading raised
                iterator._counted_failures.append(error)
            raise
        finally:
            iterator._source_s += time.perf_counter() - started


def _take(failures: list[BaseException], error: BaseException) -> bool:
    """Remove ``error`` from ``failures`` (by identity); whether it was there."""
    for i, failure in enumerate(failures):
        if failure is error:
            del failures[i]
            return True
    return False


class SingleProcessIter(SeededDatasetMixin, LoaderIterMixin, _SingleProcessDataLoaderIter):
    """One epoch loaded in the main process, without disturbing the training loop's RNGs."""

    def __init__(self, loader: Any, epoch: int, skip: int = 0) -> None:
        self._seed = loader.seed
        self._seeding = seeding_options(loader)
        self._cursor = loader._cursor
        # no other process reads it: a plain C integer, not shared memory (20 us an epoch)
        self._shared_epoch = ctypes.c_longlong(epoch)
        self._schedule = None
        if loader._dataset_kind == _DatasetKind.Map:
            self._schedule = schedule_for(loader, may_cross=False)
            self._schedule.start(epoch, skip)
        self._rng_swap = RNGStateSwap(self._schedule is None, loader.seed_rngs != "never")
        self._delivered = 0
        super().__init__(loader)
        dataset = self._dataset
        # NOTE [ Seeding contract ]: the dataset keeps the training loop's states itself
        # (saving them only for batches that seed), or the states are swapped around each batch
        self._swaps = not (isinstance(dataset, SeededDataset) and dataset.keep_training_states())
        self._bind(loader)

    def begin_epoch(self, loader: Any, epoch: int, skip: int = 0) -> None:
        """Load ``epoch`` from position ``skip`` on (a ``Mix``'s weights changed mid-epoch,
        NOTE [ Weight changes ]): one process loads no further ahead than its schedule."""
        self._schedule.start(epoch, skip)

    def _next_index(self) -> Any:
        index = super()._next_index()
        self._delivered += 1
        return index

    def _next_data(self) -> Any:
        if not self._swaps:
            return super()._next_data()
        with self._rng_swap:
            return super()._next_data()
