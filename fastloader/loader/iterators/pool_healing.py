"""``PoolHealing``: how ``WorkerPoolIter`` finds dead workers and replaces them.

Runs in the main process. The mechanics only: what a death means (resend, poison, broken) is
``loader.supervision.judge_death``'s to say. See NOTE [ Supervised workers ] in
loader/supervision.py and NOTE [ torch internals fastloader relies on ] in __init__.py (the
worker is started with torch's own ``_worker_loop``).
"""

from __future__ import annotations

import threading
import time

from torch.utils.data import _utils

from fastloader.loader import supervision as _supervision
from fastloader.loader.seeding import Task
from fastloader.loader.supervision import (
    NOT_STARTED,
    DeathVerdict,
    WorkersLostError,
    judge_death,
    release_orphaned_write_lock,
    stall_report,
    warn_death,
    warn_never_started,
)
from fastloader.loader.transport import receive
from fastloader.loader.transport.forks import workers_starting
from fastloader.loader.transport.groups import Batches, TaskGroup
from fastloader.loader.transport.pipes import write_directly


class PoolHealing:
    """Supervision's part of the worker pool (a mixin of ``WorkerPoolIter``)."""

    def _dead_slots(self) -> list[int]:
        return [slot for slot, worker in enumerate(self._workers) if not worker.is_alive()]

    def _wait_for_a_death(self, seconds: float) -> list[int]:
        # The sender of a result that cannot be rebuilt is exiting; wait until it is gone.
        deadline = time.monotonic() + seconds
        while not (dead := self._dead_slots()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return dead

    def _check_starts(self) -> None:
        # NOTE [ Worker start-up ] (loader/supervision.py)
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
        # Mechanics only; what a death means is _supervision.judge_death's to say.
        for slot in slots:
            old = self._workers[slot]
            old.join(timeout=0)
            unfinished = sorted(
                number
                for number, info in self._task_info.items()
                if len(info) == 1 and info[0] == slot
            )
            current = self._progress[slot]
            # NOTE [ Batches per message ]: a group's death is blamed on the batch being loaded
            culprit = self._batch_in_group(slot, current)
            tasks = self._sent_tasks if culprit is None else {**self._sent_tasks, current: culprit}
            verdict = judge_death(
                self._ledger, slot, old.pid, old.exitcode, current, unfinished, tasks
            )
            if self._groups.size > 1 or self._groups.adapts:  # NOTE [ Batches per message ]
                self._groups.stop()  # one batch per message from now on
                self._prefetch_factor = self._batch_depth or self._prefetch_factor
            resend = self._settle(verdict, culprit is not None, slot)
            if verdict.broken is not None:
                self._broken = verdict.broken
                raise WorkersLostError(self._broken)
            if not never_started:  # one that never ran cannot hold the lock: a live one does
                self._reads.drop_torn()
                release_orphaned_write_lock(self._worker_result_queue)
            if self._slot_key is not None:  # NOTE [ Batch transport ], "Slot lifetime"
                receive.reclaim_unsent(self._slot_key, slot)
            self._replace(slot, resend)
            if never_started:
                warn_never_started(slot, old.pid, replaced=True)
            else:
                warn_death(slot, old.pid, old.exitcode, len(resend))

    def _settle(self, verdict: DeathVerdict, in_group: bool, slot: int) -> list[int]:
        """Carry out a poison verdict; the numbers of the tasks to send again."""
        resend = verdict.resend
        if verdict.poisoned is not None and in_group:
            # the group goes again, the poison batch skipped: its error is its result
            number, result = verdict.poisoned
            group = self._sent_tasks[number]
            skipped = (*group.skipped, (self._group_progress[slot], result))
            self._sent_tasks[number] = group._replace(skipped=skipped)
            self._ledger.forget(number)  # another batch of it starts with no deaths
            resend = [number, *resend]
        elif verdict.poisoned is not None:
            number, result = verdict.poisoned
            task = self._sent_tasks.pop(number, None)
            if type(task) is TaskGroup:  # died past its loads: every batch raises it
                result = Batches([result] * len(task.batches))
            # handed on by _get_data as the task's result, so torch's loop goes on even
            # when no other result will come (the following tasks are poison too)
            self._settled.append((number, result))
        return resend

    def _replace(self, slot: int, resend: list[int]) -> None:
        """Start a new worker in ``slot`` and send it the dead one's tasks again."""
        try:
            self._start_worker(slot)
        except Exception as error:
            self._broken = f"fastloader: cannot start a replacement DataLoader worker: {error}"
            raise WorkersLostError(self._broken) from error
        queue = self._index_queues[slot]
        if self._resetting:
            queue.put(_utils.worker._ResumeIteration(self._shared_seed))
        for number in resend:
            queue.put((number, self._sent_tasks[number]))
        self._replaced += 1

    def _batch_in_group(self, slot: int, current: int) -> Task | None:
        """The batch of group task ``current`` that worker ``slot`` was loading, as a
        ``Task``; None when ``current`` is not a group."""
        group = self._sent_tasks.get(current)
        if type(group) is not TaskGroup or self._group_progress is None:
            return None
        position = self._group_progress[slot]
        if not 0 <= position < len(group.batches):  # past its loads (collate, sending)
            return None
        return Task(group.epoch, group.batches[position], group.number)

    def _start_worker(self, slot: int) -> None:
        index_queue = self._process_factory.Queue()
        index_queue.cancel_join_thread()
        write_directly(index_queue)  # NOTE [ Puts without a feeder thread ]
        self._worker_init_fn.forked_from_main_thread = in_main_thread()
        self._progress[slot] = NOT_STARTED
        self._writing[slot] = 0  # the dead worker's lock was released: NOTE [ Torn results ]
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
        with workers_starting():  # NOTE [ Batch transport ], "A batch in another process"
            worker.start()
        self._starting[slot] = time.monotonic()
        old_queue = self._index_queues[slot]
        old_queue.cancel_join_thread()
        old_queue.close()
        self._index_queues[slot] = index_queue
        self._workers[slot] = worker
        self._workers_status[slot] = True

    def _stall_report(self) -> str:
        held: dict[int, list[int]] = {}
        for number, info in sorted(self._task_info.items()):
            if len(info) == 1:
                held.setdefault(info[0], []).append(number)
        pids = [worker.pid for worker in self._workers]
        progress = list(self._progress) if self._progress is not None else None
        tasks = dict(self._sent_tasks)
        for slot, current in enumerate(progress or ()):  # a group: the batch being loaded
            culprit = self._batch_in_group(slot, current)
            if culprit is not None:
                tasks[current] = culprit
        return stall_report(self._timeout, pids, held, progress, tasks, self._stack_folder)


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
