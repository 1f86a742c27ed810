"""``WorkerPoolIter``: worker processes kept across epochs, fed ahead, and supervised.

Runs in the main process; the workers run torch's worker loop with the objects built here (the
seeded dataset wrapper, ``WorkerInit``). See NOTE [ torch internals fastloader relies on ] in
__init__.py, NOTE [ Cross-epoch prefetch ] in loader/schedule.py and NOTE [ Supervised workers ] in
loader/supervision.py.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import (
    _utils,
)
from torch.utils.data.dataloader import (
    _DatasetKind,
    _MultiProcessingDataLoaderIter,
)

from fastloader.loader.iterators.common import (
    LoaderIterMixin,
    SeededDatasetMixin,
    order_is_predictable,
    schedule_for,
)
from fastloader.loader.iterators.pool_healing import PoolHealing, in_main_thread
from fastloader.loader.iterators.slot_collate import into_slots
from fastloader.loader.iterators.worker_loop import read_tasks_directly
from fastloader.loader.prefetch_depth import batch_bytes, prefetch_depth
from fastloader.loader.result_queue import guard_reads
from fastloader.loader.seeding import Task, seeding_options
from fastloader.loader.supervision import (
    NOT_STARTED,
    POLL_S,
    DeathLedger,
    WorkersLostError,
    warn_reseeded,
)
from fastloader.loader.transport import receive
from fastloader.loader.transport.forks import workers_starting
from fastloader.loader.transport.groups import Batches, GroupPlan, Parts, TaskGroup
from fastloader.loader.transport.pipes import write_directly
from fastloader.loader.transport.receive import STALE
from fastloader.loader.transport.send import SlotCollate
from fastloader.loader.transport.slots import SlotFile
from fastloader.loader.worker_guard import WorkerInit, make_stack_folder


class WorkerPoolIter(
    SeededDatasetMixin, LoaderIterMixin, PoolHealing, _MultiProcessingDataLoaderIter
):
    """Worker processes that serve epoch after epoch, supervised.

    See NOTE [ Cross-epoch prefetch ] and NOTE [ Supervised workers ] (loader/supervision.py).
    """

    supervise = True  # False turns supervision off (benchmarks/supervision.py measures it)
    slots = True  # False sends batches torch's way (benchmarks/transport.py measures it)

    def __init__(self, loader: Any, epoch: int, skip: int = 0) -> None:
        self._seed = loader.seed
        self._seeding = seeding_options(loader)
        self._cursor = loader._cursor
        context = loader.multiprocessing_context or multiprocessing.get_context()
        self._shared_epoch = context.RawValue("q", epoch)
        self._schedule = None
        if loader._dataset_kind == _DatasetKind.Map:
            may_cross = loader.persistent_workers and order_is_predictable(loader)
            self._schedule = schedule_for(loader, may_cross)
            self._schedule.start(epoch, skip)
        self._supervised = WorkerPoolIter.supervise and self._schedule is not None
        self._starting: dict[int, float] = {}  # slot -> when started (NOTE [ Worker start-up ])
        self._forks = context.get_start_method() == "fork"
        self._shared_arrays(context, loader.num_workers)
        self._process_factory = loader.multiprocessing_context or torch.multiprocessing
        self._ledger = DeathLedger()
        self._sent_tasks: dict[int, Task] = {}
        self._settled: list[tuple[int, Any]] = []  # poison verdicts, handed on as results
        self._resetting = False
        self._replaced = 0  # workers replaced so far
        self._broken: str | None = None
        self._parent_pid = os.getpid()
        self._stack_folder = make_stack_folder(self)  # NOTE [ Worker stacks on timeout ]
        self._reseeded = None  # see WorkerInit; checked until the first epoch ends
        if loader.worker_init_fn is not None and "reseeded" not in loader._warned:
            self._reseeded = context.RawValue("b", 0)
        self._slot_key = None  # NOTE [ Batch transport ]
        if WorkerPoolIter.slots:
            self._slot_key = receive.register(
                [SlotFile.create() for _ in range(loader.num_workers)]
            )
            weakref.finalize(self, receive.unregister, self._slot_key)
        self._epoch = epoch
        self._delivered = skip
        self._epoch_done = False
        # from the first batch's bytes, unless the user chose: NOTE [ Prefetch depth by batch
        # bytes ] in loader/prefetch_depth.py
        self._depth_pending = self._schedule is not None and loader._prefetch_by_bytes
        self._batch_depth = 0  # batches in flight per worker, once known from the first batch
        # NOTE [ Batches per message ] in loader/transport/groups.py
        self._groups = GroupPlan(
            self._depth_pending
            and self._slot_key is not None
            and loader._auto_collation
            and not self._seeding.get("collate_may_draw", True)
        )
        started = time.perf_counter()
        with workers_starting():  # NOTE [ Batch transport ], "A batch in another process"
            super().__init__(loader)
        self.startup_s = time.perf_counter() - started
        self._reads = guard_reads(self._worker_result_queue, self._writing, self._workers)
        if self._supervised:  # from when every worker has been started (not before forking)
            self._starting = dict.fromkeys(range(loader.num_workers), time.monotonic())
        self._bind(loader)

    def _shared_arrays(self, context: Any, workers: int) -> None:
        # what workers write and the main process reads, one entry per worker slot
        if self._supervised:
            self._progress = context.RawArray("q", [NOT_STARTED] * workers)
            self._group_progress = context.RawArray("q", workers)
        if self._schedule is not None:
            self.busy_seconds = context.RawArray("d", workers)
        self._writing = context.RawArray("b", workers)  # NOTE [ Torn results ]

    @property
    def _worker_init_fn(self) -> WorkerInit:
        return self.__dict__["_fastloader_worker_init"]

    @_worker_init_fn.setter
    def _worker_init_fn(self, user_fn: Callable[[int], None] | None) -> None:
        if not isinstance(user_fn, WorkerInit):
            user_fn = WorkerInit(
                user_fn, self._parent_pid, self._stack_folder, self._reseeded, self._writing
            )
            user_fn.forked_from_main_thread = in_main_thread()
            user_fn.on_start = read_tasks_directly  # NOTE [ Puts without a feeder thread ]
        self.__dict__["_fastloader_worker_init"] = user_fn

    @property
    def _worker_result_queue(self) -> Any:
        return self.__dict__["_fastloader_result_queue"]

    @_worker_result_queue.setter
    def _worker_result_queue(self, queue: Any) -> None:
        # set by torch after _worker_init_fn, before workers start: each worker writes its
        # results to this very object without a feeder thread (NOTE [ Puts without a feeder
        # thread ] in loader/transport/pipes.py)
        self._worker_init_fn.result_queue = queue
        self.__dict__["_fastloader_result_queue"] = queue

    @property
    def _collate_fn(self) -> Any:
        return self.__dict__["_fastloader_collate_fn"]

    @_collate_fn.setter
    def _collate_fn(self, collate_fn: Any) -> None:
        # NOTE [ Batch transport ]: workers write batches into shared-memory slots
        if self._slot_key is not None and not isinstance(collate_fn, SlotCollate):
            collate_fn = into_slots(collate_fn)
            fds = [slots.fd for slots in receive.slot_files(self._slot_key)]
            collate_fn = SlotCollate(collate_fn, fds, self._slot_key)
        self.__dict__["_fastloader_collate_fn"] = collate_fn

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
        continues = self._schedule is not None and self._continues_into(epoch, skip)
        self._groups.new_epoch()
        self._epoch = epoch  # before any task is sent: they go one epoch past it at most
        if self._schedule is None:  # iterable dataset: torch's reset, with the new epoch
            self._shared_epoch.value = epoch
            self._reset(loader)
        elif continues:
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
        # never past the next epoch: NOTE [ Cross-epoch prefetch ] continues one epoch only
        task = self._schedule.next_task(number, last_epoch=self._epoch + 1)
        if self._groups.size > 1:  # NOTE [ Batches per message ]
            task = self._groups.grow(task, self._schedule, number)
        self._sent_tasks[number] = task
        return task

    def _try_put_index(self) -> None:
        # the depth in messages shrinks when batches start to travel in groups: torch asserts
        # that no task is put beyond it
        if self._tasks_outstanding < self._prefetch_factor * self._num_workers:
            super()._try_put_index()

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        if first_iter and self._supervised and self._worker_pids_set:
            # torch registered the new workers with its SIGCHLD handler just before this first
            # reset; that handler would raise inside whatever the main thread runs when a worker
            # dies, and supervision finds dead workers itself (NOTE [ Supervised workers ]).
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        if first_iter:  # before the first task is put (NOTE [ Puts without a feeder thread ])
            for index_queue in self._index_queues:
                write_directly(index_queue)
        self._sent_tasks.clear()
        self._settled.clear()
        self._ledger.reset()
        self._groups.new_epoch()
        self._resetting = True
        try:
            super()._reset(loader, first_iter)
        finally:
            self._resetting = False

    def _next_data(self) -> Any:
        if self._groups.pending:  # the rest of a group already received
            return self._hand_out()
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
        if self._reseeded is not None and self._reseeded.value:
            self._warn_reseeded()
        if type(data) is Parts:  # NOTE [ Batches per message ], "Memory"
            data = data.joined()
        if type(data) is Batches:  # NOTE [ Batches per message ]
            super()._process_data(data, worker_idx)  # torch sends the next task
            self._groups.pending.extend(data)
            if self._groups.adapts and data.nbytes and self._groups.fit(data.nbytes // len(data)):
                self._fit_messages()
            return self._hand_out()
        # Counted before torch re-raises a failed batch: it counts toward the epoch's end.
        self._delivered += 1
        batch = super()._process_data(data, worker_idx)
        if self._depth_pending:  # NOTE [ Prefetch depth by batch bytes ]
            self._depth_pending = False
            self._prefetch_factor = self._batch_depth = prefetch_depth(batch)
            self._fill()
        elif self._groups.adapts:
            self._count_for_groups(batch)
        return batch

    def _hand_out(self) -> Any:
        item = self._groups.pending.popleft()
        self._delivered += 1  # (a batch that failed counts too, as above)
        if self._groups.adapts:
            self._count_for_groups(item)
        if isinstance(item, ExceptionWrapper):
            item.reraise()
        return item

    def _count_for_groups(self, batch: Any) -> None:
        # NOTE [ Batches per message ]: decided from the timing and this batch's bytes
        if self._groups.count() and not isinstance(batch, ExceptionWrapper):
            self._groups.decide(self._num_workers, batch_bytes(batch))
            self._fit_messages()

    def _fit_messages(self) -> None:
        # messages in flight per worker follow the group size
        self._prefetch_factor = max(2, -(-self._batch_depth // self._groups.size))

    def _warn_reseeded(self) -> None:
        self._reseeded = None
        loader = self._loader_ref()
        if loader is not None:
            loader._warned.add("reseeded")
        warn_reseeded()

    def _get_data(self) -> Any:
        while True:
            if self._broken is not None:
                raise WorkersLostError(self._broken)
            if self._timeout > 0:
                item = self._get_within_timeout()
            else:  # torch's wait (pin-memory thread check included)
                item = super()._get_data()
            if not _stale(item[1]) and self._is_expected(item[0]):
                return item

    def _get_within_timeout(self) -> Any:
        # torch's timeout is the wait for one batch: while a group loads, the wait starts
        # again with each of its batches (NOTE [ Batches per message ], "Timeouts")
        seen = self._batch_progress()
        deadline = time.monotonic() + self._timeout * self._unwatched_batches()
        while True:
            wait = max(0.0, min(POLL_S, deadline - time.monotonic()))
            success, item = self._try_get_data(wait)
            if success:
                return item
            now = self._batch_progress()
            if now != seen:
                seen, deadline = now, time.monotonic() + self._timeout
            elif time.monotonic() >= deadline:
                raise RuntimeError(self._stall_report())

    def _batch_progress(self) -> list[tuple[int, int]]:
        """What moves while the awaited workers load: each one's task and batch of its group
        (nothing without supervision)."""
        if self._group_progress is None:
            return []
        if self._in_order:
            info = self._task_info.get(self._rcvd_idx)
            slots = {info[0]} if info is not None and len(info) == 1 else set()
        else:
            slots = {info[0] for info in self._task_info.values() if len(info) == 1}
        return [(self._progress[slot], self._group_progress[slot]) for slot in sorted(slots)]

    def _unwatched_batches(self) -> int:
        """Batches in the awaited message when no progress is shared (no supervision): the
        wait is the timeout for each of them."""
        if self._group_progress is not None:
            return 1
        task = self._sent_tasks.get(self._rcvd_idx)
        return len(task.batches) if type(task) is TaskGroup else 1

    def _is_expected(self, idx: Any) -> bool:
        """Whether a result is one torch waits for (not a duplicate after a replacement)."""
        if type(idx) is int:
            info = self._task_info.get(idx)
            if info is None or len(info) != 1:
                return False  # delivered already, by a worker that died after sending it
            if self._sent_tasks:
                self._sent_tasks.pop(idx, None)
            if self._replaced:
                self._ledger.progressed(info[0])
            return True
        # an extra acknowledgement from a worker replaced during a reset is dropped
        return self._resetting or not isinstance(idx, _utils.worker._ResumeIteration)

    def _try_get_data(self, timeout: float = _utils.MP_STATUS_CHECK_INTERVAL) -> Any:
        if not self._supervised:
            return super()._try_get_data(timeout)
        deadline = time.monotonic() + timeout
        while True:
            if self._settled:  # a poison verdict is the result of its task
                return True, self._settled.pop(0)
            wait = min(POLL_S, max(0.0, deadline - time.monotonic()))
            success, data = self._poll_results(wait)
            if success:
                return success, data
            if self._starting:
                self._check_starts()
            if not self._settled and time.monotonic() >= deadline:
                return False, None

    def _poll_results(self, wait: float) -> tuple[bool, Any]:
        """torch's wait for one result, for ``wait`` seconds; dead workers found meanwhile
        are replaced (their verdicts land in ``_settled``)."""
        try:
            return super()._try_get_data(wait)
        except RuntimeError:  # torch found a dead worker
            dead = self._dead_slots()
            if not dead:
                raise
            self._heal(dead)
        except (OSError, EOFError):
            # A result whose tensors lived in a worker that has died cannot be rebuilt.
            # Its task was (or is now) re-sent with the dead worker's other tasks.
            dead = self._wait_for_a_death(1.0)
            if dead:
                self._heal(dead)
            elif not self._replaced:
                raise
        return False, None

    def _shutdown_workers(self) -> None:
        if "_shutdown" not in self.__dict__:  # __init__ failed before starting workers
            return
        if getattr(self, "_parent_pid", os.getpid()) != os.getpid():
            self._shutdown = (
                True  # a copy collected in a forked child: the workers are the parent's
            )
            return
        super()._shutdown_workers()
        if self.__dict__.get("_slot_key") is not None:  # batches already out stay valid
            receive.unregister(self._slot_key)

    def shutdown(self) -> None:
        """Stop the worker processes now."""
        self._shutdown_workers()


def _stale(data: Any) -> bool:
    """Whether a result holds a descriptor of a row reclaimed after its worker died (its task
    was sent again: NOTE [ Batch transport ], "Writing, and the commit")."""
    return data is STALE or (type(data) is Parts and any(part is STALE for part in data))
