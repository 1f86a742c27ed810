"""Iterator subclasses of torch's: kept alive across epochs, cross-epoch prefetch, resume.

Everything here runs in the main process, except what torch's worker loop runs with the
objects built here (the seeded dataset wrappers and ``WorkerInit``).

NOTE [ torch internals fastloader relies on ]

Every touch of torch's private DataLoader machinery is in this module. Tested with torch
2.13.0 and 2.14.1 (the range pinned in pyproject.toml). We subclass
``_SingleProcessDataLoaderIter`` and ``_MultiProcessingDataLoaderIter`` (so ``iter(loader)``
is torch's iterator, ``_BaseDataLoaderIter``) and rely on:

- ``_BaseDataLoaderIter.__init__`` assigning ``self._dataset`` and the multiprocessing
  iterator reading ``self._worker_init_fn`` before it starts workers: both are properties here,
  so workers receive the seeded wrapper and fastloader's init function;
- ``_BaseDataLoaderIter.__next__`` (profiler label, ``_num_yielded``), called around our
  bookkeeping;
- ``_next_index()`` being the only place indices are drawn (``_try_put_index`` treats its
  StopIteration as "nothing to send now"), called just before a task is sent as
  ``(self._send_idx, task)``;
- ``_next_data()``, ``_reset(loader)``, ``_try_put_index()``, ``_process_data()``,
  ``_get_data()``, ``_try_get_data()``, ``_shutdown_workers()`` and the state ``_send_idx``,
  ``_rcvd_idx``, ``_task_info``, ``_tasks_outstanding``, ``_prefetch_factor``, ``_in_order``,
  ``_workers``, ``_index_queues``, ``_worker_result_queue``, ``_workers_done_event``,
  ``_workers_status``, ``_base_seed``, ``_shared_seed``, ``_worker_pids_set``, ``_shutdown``;
- ``_utils.worker._worker_loop``'s argument list (replacement workers are started with it),
  ``_utils.worker._ResumeIteration``, and ``_utils.signal_handling._remove_worker_pids``
  (see NOTE [ Supervised workers ] in _supervision.py);
- ``torch.utils.data._utils.worker.WorkerInfo`` being a plain object whose ``dataset`` we
  point back at the user's dataset.

The module is longer than our ~500-line habit because all of that has to live here; what does
not touch torch internals lives in _supervision.py (main-process bookkeeping) and
_worker_guard.py (what runs in workers).

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
import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    SequentialSampler,
    _utils,
)
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _MultiProcessingDataLoaderIter,
    _SingleProcessDataLoaderIter,
)

from fastloader import _supervision
from fastloader._supervision import (
    NOT_STARTED,
    POISON_DEATHS,
    POLL_S,
    DeathLedger,
    PoisonSampleError,
    WorkersLostError,
    describe_exit,
    dump_stacks,
    error_result,
    release_orphaned_write_lock,
    stall_message,
    warn_death,
    warn_never_started,
)
from fastloader._worker_guard import WorkerInit
from fastloader.samplers import (
    EpochShuffleSampler,
    samplers_with_set_epoch,
    set_epoch_unrecorded,
)
from fastloader.seeding import (
    RNGStateSwap,
    SeededDataset,
    SeededIterableDataset,
    Task,
    seeding_options,
)

_END = object()


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

    def finish_epoch(self) -> None:
        """Count the current epoch's tasks left unsent, so that its ``lengths`` is known."""
        while self._next is not _END:
            self._advance()

    def next_task(self, number: int = -1) -> Task:
        """The next task to send (as torch's task ``number``). Raises StopIteration when nothing
        may be sent now."""
        if self._next is _END:
            if not self.may_cross or self.epoch < 0:
                raise StopIteration
            self._open(self.epoch + 1)
            if self._next is _END:
                raise StopIteration
        return Task(self.epoch, self._advance(), number)


def _schedule_for(loader: Any, may_cross: bool) -> _EpochSchedule:
    def set_epoch(epoch: int) -> None:
        for sampler in samplers:
            set_epoch_unrecorded(sampler, epoch)

    samplers = samplers_with_set_epoch(loader)
    batched = loader.batch_sampler is not None
    return _EpochSchedule(loader._index_sampler, set_epoch, may_cross, batched)


class _SeededDatasetMixin:
    """Swaps in the seeded dataset wrapper where torch's iterator stores the dataset."""

    _seed: int
    _seeding: dict = {}  # seeding_options(loader) (NOTE [ Lazy seeding ] in seeding.py)
    busy_seconds: Any = None  # per worker, seconds loading (NOTE [ The diagnosis ], stats.py)
    _shared_epoch: Any
    _progress: Any = None

    @property
    def _dataset(self) -> Any:
        return self.__dict__["_seeded_dataset"]

    @_dataset.setter
    def _dataset(self, dataset: Any) -> None:
        if isinstance(dataset, (SeededDataset, SeededIterableDataset)):
            wrapped = dataset
        elif self._schedule is None:
            seed_rngs = self._seeding.get("seed_rngs", "auto")
            wrapped = SeededIterableDataset(dataset, self._seed, self._shared_epoch, seed_rngs)
        else:
            wrapped = SeededDataset(
                dataset, self._seed, self._progress, busy=self.busy_seconds, **self._seeding
            )
        self.__dict__["_seeded_dataset"] = wrapped

    def _next_index(self) -> Any:
        if self._schedule is None:
            return super()._next_index()
        return self._schedule.next_task()


class _LoaderIterMixin:
    """Makes torch's iterator what ``iter(loader)`` returns, adding the loader's bookkeeping.

    ``__next__`` is torch's (profiler label, ``_num_yielded``, the IterableDataset length
    warning) plus loading-time stats, the loader's count of consumed batches (a batch whose
    loading raised counts too, as it does toward the end of the epoch) and, with ``device``,
    the copy to the device ahead of use. The loader is held weakly: dropping the loader or
    this iterator stops the workers as with torch.
    """

    _delivered: int  # batches of this epoch handed on (or raised), counted by each iterator
    _interrupted = False
    _source_s = 0.0  # seconds in _TorchNext during the current next() (device copies only)

    def _bind(self, loader: Any) -> None:
        self._loader_ref = weakref.ref(loader)
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
                batch = _BaseDataLoaderIter.__next__(self)
            else:
                self._source_s = 0.0  # time in _TorchNext: waiting for loading, not the copy
                batch = next(self._device_batches)
        except StopIteration:
            loader = self._loader_ref()
            if loader is not None:
                loader._epoch_complete = True
            self._stats.end_epoch(time.perf_counter() - started)
            raise
        except KeyboardInterrupt:
            self._interrupted = True
            raise
        except Exception as error:
            if self._device_batches is None:
                counted = self._delivered != delivered
            else:  # the prefetcher raises a failure after the batches pulled before it
                counted = _take(self._counted_failures, error)
            loader = self._loader_ref()
            if loader is not None and counted:
                loader.__dict__["_consumed"] += 1
            raise
        now = time.perf_counter()
        device_s = 0.0 if self._device_batches is None else now - started - self._source_s
        self._stats.record_batch(now - started, batch, now, max(0.0, device_s))
        loader = self._loader_ref()
        if loader is not None:
            # not `loader._consumed += 1`: torch's DataLoader.__setattr__ is a Python call
            loader.__dict__["_consumed"] += 1
        return batch


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
            return _BaseDataLoaderIter.__next__(iterator)
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


class SingleProcessIter(_SeededDatasetMixin, _LoaderIterMixin, _SingleProcessDataLoaderIter):
    """One epoch loaded in the main process, without disturbing the training loop's RNGs."""

    def __init__(self, loader: Any, epoch: int, skip: int = 0) -> None:
        self._seed = loader.seed
        self._seeding = seeding_options(loader)
        self._shared_epoch = multiprocessing.RawValue("q", epoch)
        self._schedule = None
        if loader._dataset_kind == _DatasetKind.Map:
            self._schedule = _schedule_for(loader, may_cross=False)
            self._schedule.start(epoch, skip)
        self._rng_swap = RNGStateSwap(self._schedule is None, loader.seed_rngs != "never")
        self._delivered = 0
        super().__init__(loader)
        self._bind(loader)

    def _next_index(self) -> Any:
        index = super()._next_index()
        self._delivered += 1
        return index

    def _next_data(self) -> Any:
        with self._rng_swap:
            return super()._next_data()


class WorkerPoolIter(_SeededDatasetMixin, _LoaderIterMixin, _MultiProcessingDataLoaderIter):
    """Worker processes that serve epoch after epoch, supervised.

    See NOTE [ Cross-epoch prefetch ] and NOTE [ Supervised workers ] (_supervision.py).
    """

    supervise = True  # False turns supervision off (benchmarks/supervision.py measures it)

    def __init__(self, loader: Any, epoch: int, skip: int = 0) -> None:
        self._seed = loader.seed
        self._seeding = seeding_options(loader)
        context = loader.multiprocessing_context or multiprocessing.get_context()
        self._shared_epoch = context.RawValue("q", epoch)
        self._schedule = None
        if loader._dataset_kind == _DatasetKind.Map:
            may_cross = loader.persistent_workers and order_is_predictable(loader)
            self._schedule = _schedule_for(loader, may_cross)
            self._schedule.start(epoch, skip)
        self._supervised = WorkerPoolIter.supervise and self._schedule is not None
        self._starting: dict[int, float] = {}  # slot -> when started (NOTE [ Worker start-up ])
        self._forks = context.get_start_method() == "fork"
        if self._supervised:
            self._progress = context.RawArray("q", [NOT_STARTED] * loader.num_workers)
        if self._schedule is not None:
            self.busy_seconds = context.RawArray("d", loader.num_workers)
        self._process_factory = loader.multiprocessing_context or torch.multiprocessing
        self._ledger = DeathLedger()
        self._sent_tasks: dict[int, Task] = {}
        self._settled: list[tuple[int, Any]] = []  # poison verdicts, handed on as results
        self._resetting = False
        self._replaced = 0  # workers replaced so far
        self._broken: str | None = None
        self._parent_pid = os.getpid()
        self._stack_folder = tempfile.mkdtemp(prefix="fastloader-stacks-")
        weakref.finalize(self, shutil.rmtree, self._stack_folder, True)
        self._reseeded = None  # see WorkerInit; checked until the first epoch ends
        if loader.worker_init_fn is not None and not getattr(loader, "_reseed_warned", False):
            self._reseeded = context.RawValue("b", 0)
        self._epoch = epoch
        self._delivered = skip
        self._epoch_done = False
        started = time.perf_counter()
        super().__init__(loader)
        self.startup_s = time.perf_counter() - started
        if self._supervised:  # from when every worker has been started (not before forking)
            self._starting = dict.fromkeys(range(loader.num_workers), time.monotonic())
        self._bind(loader)

    @property
    def _worker_init_fn(self) -> WorkerInit:
        return self.__dict__["_fastloader_worker_init"]

    @_worker_init_fn.setter
    def _worker_init_fn(self, user_fn: Callable[[int], None] | None) -> None:
        if not isinstance(user_fn, WorkerInit):
            user_fn = WorkerInit(user_fn, self._parent_pid, self._stack_folder, self._reseeded)
            user_fn.forked_from_main_thread = _in_main_thread()
        self.__dict__["_fastloader_worker_init"] = user_fn

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes."""
        return [w.pid for w in self._workers if w.is_alive()]

    def needs_restart(self) -> bool:
        """Whether the next epoch needs a fresh pool (broken, interrupted, or unsupervised)."""
        if self._shutdown or self._broken is not None or self._interrupted:
            return True
        return not self._supervised and bool(self._dead_slots())

    def begin_epoch(self, loader: Any, epoch: int, skip: int = 0) -> None:
        """Serve ``epoch`` next, from its ``skip``-th batch on."""
        if self._supervised:
            dead = self._dead_slots()
            if dead:
                self._heal(dead)
        if self._schedule is None:  # iterable dataset: torch's reset, with the new epoch
            self._shared_epoch.value = epoch
            self._reset(loader)
        elif self._continues_into(epoch, skip):
            self._fill()
        elif self._tasks_outstanding == 0 and not self._task_info:
            self._schedule.start(epoch, skip)
            # nothing in flight; after in_order=False, fastloader's own end of epoch may have
            # left torch's _rcvd_idx behind (torch catches it up only in its own walk)
            self._rcvd_idx = self._send_idx
            self._fill()
        else:  # stale batches in flight: drain them with torch's reset, then restart
            self._schedule.start(epoch, skip)
            self._reset(loader)
        self._epoch = epoch
        self._delivered = skip
        self._epoch_done = False
        self._num_yielded = 0  # torch's per-epoch count (its _reset is skipped when continuing)
        self._bind(loader)

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
        # (in_order=False hands results out as they arrive, so _rcvd_idx can lag behind; it
        # never continues into the next epoch, and begin_epoch catches _rcvd_idx up when
        # nothing is in flight.)
        limit = self._prefetch_factor * self._num_workers
        while self._send_idx - self._rcvd_idx < limit:
            sent = self._send_idx
            self._try_put_index()
            if self._send_idx == sent:
                break

    # -- what torch's loop calls ------------------------------------------------------------

    def _next_index(self) -> Any:
        if self._schedule is None:
            return super()._next_index()
        number = self._send_idx  # torch sends this task under this number
        task = self._schedule.next_task(number)
        self._sent_tasks[number] = task
        return task

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        if first_iter and self._supervised and self._worker_pids_set:
            # torch registered the new workers with its SIGCHLD handler just before this first
            # reset; that handler would raise inside whatever the main thread runs when a worker
            # dies, and supervision finds dead workers itself (NOTE [ Supervised workers ]).
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        self._sent_tasks.clear()
        self._settled.clear()
        self._ledger.reset()
        self._resetting = True
        try:
            super()._reset(loader, first_iter)
        finally:
            self._resetting = False

    def _next_data(self) -> Any:
        if self._schedule is not None:
            broken = self._broken is not None
            if broken and self._schedule.epoch == self._epoch:
                self._schedule.finish_epoch()  # no more tasks are sent: count them
            length = self._schedule.lengths.get(self._epoch)
            if self._epoch_done or (length is not None and self._delivered >= length):
                self._epoch_done = True
                raise StopIteration
            if broken:  # NOTE [ Supervised workers ]: each remaining batch raises
                self._delivered += 1
                raise WorkersLostError(self._broken)
        try:
            return super()._next_data()
        except StopIteration:
            self._epoch_done = True
            self._reseeded = None
            raise
        except WorkersLostError:
            self._delivered += 1  # raised in place of the batch torch was waiting for
            raise

    def _process_data(self, data: Any, worker_idx: int) -> Any:
        # Counted before torch re-raises a failed batch: it counts toward the epoch's end.
        self._delivered += 1
        if self._reseeded is not None and self._reseeded.value:
            self._warn_reseeded()
        return super()._process_data(data, worker_idx)

    def _warn_reseeded(self) -> None:
        self._reseeded = None
        loader = self._loader_ref()
        if loader is not None:
            loader._reseed_warned = True
        warnings.warn(
            "fastloader: worker_init_fn changed the global random states (for example torch's "
            "seed_worker recipe). fastloader seeds random, numpy.random and torch for every "
            "sample from (seed, epoch, index), so what worker_init_fn seeds does not reach "
            "dataset[i]; pass DataLoader(seed=...) to choose the seed instead.",
            RuntimeWarning,
            stacklevel=5,
        )

    def _get_data(self) -> Any:
        while True:
            if self._broken is not None:
                raise WorkersLostError(self._broken)
            if self._timeout > 0:
                success, item = self._try_get_data(self._timeout)
                if not success:
                    raise RuntimeError(self._stall_report())
            else:  # torch's wait (pin-memory thread check included)
                item = super()._get_data()
            idx, data = item
            if type(idx) is int:
                info = self._task_info.get(idx)
                if info is None or len(info) != 1:
                    continue  # delivered already, by a worker that died after sending it
                if self._sent_tasks:
                    self._sent_tasks.pop(idx, None)
                if self._replaced:
                    self._ledger.progressed(info[0])
                return idx, data
            if not self._resetting and isinstance(idx, _utils.worker._ResumeIteration):
                continue  # an extra acknowledgement from a worker replaced during a reset
            return idx, data

    def _try_get_data(self, timeout: float = _utils.MP_STATUS_CHECK_INTERVAL) -> Any:
        if not self._supervised:
            return super()._try_get_data(timeout)
        if self._settled:  # a poison verdict is the result of its task
            return True, self._settled.pop(0)
        deadline = None
        wait = POLL_S if timeout > POLL_S else timeout
        while True:
            try:
                success, data = super()._try_get_data(wait)
            except RuntimeError:
                dead = self._dead_slots()
                if not dead:
                    raise
                self._heal(dead)
                if self._settled:
                    return True, self._settled.pop(0)
                success, data = False, None
            except (OSError, EOFError):
                # A result whose tensors lived in a worker that has died cannot be rebuilt.
                # Its task was (or is now) re-sent with the dead worker's other tasks.
                dead = self._wait_for_a_death(1.0)
                if dead:
                    self._heal(dead)
                    if self._settled:
                        return True, self._settled.pop(0)
                elif not self._replaced:
                    raise
                success, data = False, None
            if success:
                return success, data
            if self._starting:
                self._check_starts()
                if self._settled:
                    return True, self._settled.pop(0)
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout - wait
            if now >= deadline:
                return False, None
            wait = min(POLL_S, deadline - now)

    def _shutdown_workers(self) -> None:
        if "_shutdown" in self.__dict__:  # not when __init__ failed before starting workers
            super()._shutdown_workers()

    def shutdown(self) -> None:
        """Stop the worker processes now."""
        self._shutdown_workers()

    # -- supervision: see NOTE [ Supervised workers ] ---------------------------------------

    def _dead_slots(self) -> list[int]:
        return [slot for slot, worker in enumerate(self._workers) if not worker.is_alive()]

    def _wait_for_a_death(self, seconds: float) -> list[int]:
        # The sender of a result that cannot be rebuilt is exiting; wait until it is gone.
        deadline = time.monotonic() + seconds
        while not (dead := self._dead_slots()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return dead

    def _check_starts(self) -> None:
        # NOTE [ Worker start-up ] (_supervision.py)
        now = time.monotonic()
        for slot, since in list(self._starting.items()):
            if self._progress[slot] != NOT_STARTED:
                del self._starting[slot]
            elif now - since >= _supervision.STARTUP_TIMEOUT_S:
                del self._starting[slot]
                worker = self._workers[slot]
                if not self._forks:
                    warn_never_started(slot, worker.pid, replaced=False)
                    continue
                if self._progress[slot] != NOT_STARTED:  # it started just now after all
                    continue
                worker.kill()
                worker.join(timeout=5.0)
                self._heal([slot], never_started=True)

    def _heal(self, slots: list[int], never_started: bool = False) -> None:
        for slot in slots:
            old = self._workers[slot]
            old.join(timeout=0)
            exitcode = old.exitcode
            unfinished = sorted(
                number
                for number, info in self._task_info.items()
                if len(info) == 1 and info[0] == slot
            )
            self._blame(slot, exitcode, unfinished)
            if not self._ledger.restarted(slot):
                self._broken = (
                    f"fastloader: DataLoader worker {slot} died again before delivering a batch "
                    f"(pid {old.pid} {describe_exit(exitcode)}); workers cannot be restored. "
                    "Every remaining batch of this epoch raises this error; the next epoch "
                    "starts fresh workers."
                )
                raise WorkersLostError(self._broken)
            if not never_started:  # one that never ran cannot hold the lock: a live one does
                release_orphaned_write_lock(self._worker_result_queue)
            try:
                self._start_worker(slot)
            except Exception as error:
                self._broken = f"fastloader: cannot start a replacement DataLoader worker: {error}"
                raise WorkersLostError(self._broken) from error
            queue = self._index_queues[slot]
            if self._resetting:
                queue.put(_utils.worker._ResumeIteration(self._shared_seed))
            for number in unfinished:
                queue.put((number, self._sent_tasks[number]))
            self._replaced += 1
            if never_started:
                warn_never_started(slot, old.pid, replaced=True)
            else:
                warn_death(slot, old.pid, exitcode, len(unfinished))

    def _blame(self, slot: int, exitcode: int | None, unfinished: list[int]) -> None:
        # Only the task the worker had started is blamed; see NOTE [ Supervised workers ].
        current = self._progress[slot]
        if current not in unfinished:
            return
        if self._ledger.blame(current, exitcode) < POISON_DEATHS:
            return
        task = self._sent_tasks.pop(current)
        message = self._ledger.poison_message(current, task)
        # Handed on by _get_data as the task's result, so torch's loop goes on even when no
        # other result will come (the following tasks are poison too).
        self._settled.append((current, error_result(PoisonSampleError(message))))
        unfinished.remove(current)
        self._ledger.progressed(slot)  # a poison verdict settles a task: that is progress

    def _start_worker(self, slot: int) -> None:
        index_queue = self._process_factory.Queue()
        index_queue.cancel_join_thread()
        self._worker_init_fn.forked_from_main_thread = _in_main_thread()
        self._progress[slot] = NOT_STARTED
        worker = self._process_factory.Process(
            target=_utils.worker._worker_loop,
            args=(
                self._dataset_kind,
                self._dataset,
                index_queue,
                self._worker_result_queue,
                self._workers_done_event,
                self._auto_collation,
                self._collate_fn,
                self._drop_last,
                self._base_seed,
                self._worker_init_fn,
                slot,
                self._num_workers,
                self._persistent_workers,
                self._shared_seed,
            ),
        )
        worker.daemon = True
        worker.start()
        self._starting[slot] = time.monotonic()
        old_queue = self._index_queues[slot]
        old_queue.cancel_join_thread()
        old_queue.close()
        self._index_queues[slot] = index_queue
        self._workers[slot] = worker
        self._workers_status[slot] = True

    def _stall_report(self) -> str:
        holdings = {}
        unfinished: dict[int, list[int]] = {}
        for number, info in sorted(self._task_info.items()):
            if len(info) == 1:
                unfinished.setdefault(info[0], []).append(number)
        for slot, worker in enumerate(self._workers):
            numbers = unfinished.get(slot, [])
            current = self._progress[slot] if self._progress is not None else -1
            holdings[slot] = (
                worker.pid,
                [self._sent_tasks.get(n, n) for n in numbers],
                self._sent_tasks.get(current) if current in numbers else None,
            )
        busy = [(slot, holdings[slot][0]) for slot, held in holdings.items() if held[1]]
        not_started = {
            slot
            for slot in holdings
            if self._progress is not None and self._progress[slot] == NOT_STARTED
        }
        stacks = dump_stacks(self._stack_folder, busy)
        return stall_message(self._timeout, holdings, stacks, not_started)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
