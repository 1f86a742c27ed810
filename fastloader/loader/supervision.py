"""Worker supervision policy, in the main process: what a death means, warnings, poison samples,
stall reports. The mechanics (noticing deaths, starting replacements, re-sending tasks) are the
pool iterator's, in loader/iterators/, which asks ``judge_death`` what each death means.

NOTE [ Supervised workers ]

Every task a worker is sent carries its epoch and indices, and every sample is seeded from
(seed, epoch, index) (NOTE [ Seeding contract ] in loader/seeding.py), so a task lost with its
worker can be loaded again by another process with an identical result. The pool iterator
(``WorkerPoolIter`` in loader/iterators/) therefore keeps each task until its result arrives; when
it finds a worker dead (the data queue stays empty for a short poll, or an epoch starts), it
warns once for that death, starts a replacement in the same slot, and re-sends the dead
worker's unfinished tasks with their original task numbers, so torch's in-order delivery puts
every batch back where it belongs. A result that arrives twice (the dead worker had sent it
just before dying) is dropped.

Each worker writes the number of the task it is loading into a shared array before loading
it, so a death is blamed on that task only. A task blamed for ``POISON_DEATHS`` deaths is a
poison sample: it becomes an error result for its batch (like an exception in
``dataset[i]``), naming the epoch and indices, and the epoch goes on; the verdict settles the
task, so it counts as progress of its slot. A slot whose replacements keep dying without
delivering anything (or settling a poison task) means workers cannot be restored: the pool is
marked broken, and every remaining ``next()`` of the epoch raises ``WorkersLostError`` (one
result per batch, so a loop that catches errors and goes on still sees ``len(loader)``
results, never a short epoch); the next epoch starts a fresh pool, which raises again if its
workers cannot be restored either.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any, NamedTuple

from torch._utils import ExceptionWrapper

from fastloader.loader.worker_guard import STACK_SIGNAL, stack_file

POISON_DEATHS = 3  # deaths blamed on one task before it is reported as a poison sample
RESTARTS_WITHOUT_PROGRESS = 5  # replacements of one slot in a row that deliver nothing
POLL_S = 0.1  # how long the main process waits on the data queue before checking workers
NOT_STARTED = -2  # a worker's progress slot until its first Python code runs (WorkerInit)
STARTUP_TIMEOUT_S = 60.0  # a worker that has not started by then: see NOTE [ Worker start-up ]

# NOTE [ Worker start-up ]
# A worker forked from a process in which other threads run (a DDP rank's communication
# threads, a Lightning or user thread) can inherit a lock that one of those threads held at the
# fork, and deadlock in the child before it runs any Python: alive, never loading anything, so
# neither death detection nor anything else would end the wait. Each worker therefore marks its
# progress slot as soon as fastloader's start-up code runs (WorkerInit, right after torch's worker
# prelude); a slot still unmarked STARTUP_TIMEOUT_S after its process was started means it never
# started (with a `timeout` shorter than that, the timeout's error names such a worker). A
# forked worker cannot be slow to start (it imports and unpickles nothing), so it is killed and
# replaced like a dead one (the deadlock is a race: the replacement starts); a spawned or
# forkserver worker can be (imports, a large dataset to unpickle), so it is only reported, once.


class PoisonSampleError(RuntimeError):
    """A task that killed the worker loading it ``POISON_DEATHS`` times."""


class WorkersLostError(RuntimeError):
    """Worker processes die faster than they can be replaced."""


def describe_exit(exitcode: int | None) -> str:
    """Say how a worker process ended, from its ``exitcode``."""
    if exitcode is None:
        return "ended (exit status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        text = f"was killed by {name}"
        if -exitcode == signal.SIGKILL:
            text += " (likely the OOM killer: check memory use per worker)"
        elif -exitcode == signal.SIGSEGV:
            text += " (a crash in native code)"
        return text
    if exitcode == 0:
        return "exited with code 0 (for example after Ctrl-C reached the process group)"
    return f"exited with code {exitcode}"


def warn_death(slot: int, pid: int | None, exitcode: int | None, resent: int) -> None:
    """Warn once about one worker's death."""
    warnings.warn(
        f"fastloader: DataLoader worker {slot} (pid {pid}) {describe_exit(exitcode)}; "
        f"started a replacement and re-sent its {resent} unfinished batch(es). "
        "The epoch's batches are unchanged.",
        RuntimeWarning,
        stacklevel=4,
    )


def warn_never_started(slot: int, pid: int | None, replaced: bool) -> None:
    """Warn once about a worker that did not start (NOTE [ Worker start-up ])."""
    if replaced:
        what = (
            "never reached its start-up code (a forked process can deadlock on a lock another "
            "thread held at the fork); it was killed and replaced, and its batches re-sent. "
            "multiprocessing_context='forkserver' avoids such forks."
        )
    else:
        what = (
            "has not started yet (still importing, or unpickling the dataset, or stuck); "
            "the loader keeps waiting for it."
        )
    warnings.warn(
        f"fastloader: DataLoader worker {slot} (pid {pid}) did not start within "
        f"{STARTUP_TIMEOUT_S:g} s: it {what}",
        RuntimeWarning,
        stacklevel=4,
    )


class _ErrorResult(ExceptionWrapper):
    """A batch result that raises ``error`` where torch re-raises a worker's exception."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def reraise(self) -> None:
        raise self.error


def error_result(error: BaseException) -> ExceptionWrapper:
    """An error in the form torch's iterator re-raises for one batch."""
    return _ErrorResult(error)


class DeathLedger:
    """Counts deaths per task and restarts per slot, and decides what a death means."""

    def __init__(self) -> None:
        self.deaths_by_task: dict[int, list[str]] = {}
        self.restarts_without_progress: dict[int, int] = {}

    def reset(self) -> None:
        """Task numbers start again from 0 (torch's ``_reset``)."""
        self.deaths_by_task.clear()

    def blame(self, task_number: int, exitcode: int | None) -> int:
        """Record a death while loading ``task_number``; return the deaths blamed on it."""
        causes = self.deaths_by_task.setdefault(task_number, [])
        causes.append(describe_exit(exitcode))
        return len(causes)

    def poison_message(self, task_number: int, task: Any) -> str:
        causes = "; ".join(self.deaths_by_task.get(task_number, []))
        epoch = getattr(task, "epoch", "?")
        indices = getattr(task, "indices", task)
        return (
            f"fastloader: loading sample indices {indices!r} of epoch {epoch} killed the "
            f"DataLoader worker {POISON_DEATHS} times ({causes}). This is likely a poison "
            "sample (a crash or runaway memory in dataset[i] or collate_fn for these indices). "
            "This batch is skipped with this error; the epoch goes on."
        )

    def restarted(self, slot: int) -> bool:
        """Record a replacement of ``slot``; False once it keeps dying without progress."""
        count = self.restarts_without_progress.get(slot, 0) + 1
        self.restarts_without_progress[slot] = count
        return count <= RESTARTS_WITHOUT_PROGRESS

    def forget(self, task_number: int) -> None:
        """Drop the deaths blamed on a task (a batch of its group was judged: NOTE [ Batches
        per message ])."""
        self.deaths_by_task.pop(task_number, None)

    def progressed(self, slot: int) -> None:
        if self.restarts_without_progress:
            self.restarts_without_progress.pop(slot, None)


class DeathVerdict(NamedTuple):
    """What one worker death means (see NOTE [ Supervised workers ])."""

    resend: list[int]  # task numbers to re-send to the replacement, in order
    poisoned: tuple[int, ExceptionWrapper] | None  # (task number, its error result)
    broken: str | None  # set when workers cannot be restored: the error to raise


def judge_death(
    ledger: DeathLedger,
    slot: int,
    pid: int | None,
    exitcode: int | None,
    current: int,
    unfinished: list[int],
    tasks: dict[int, Any],
) -> DeathVerdict:
    """Decide what the death of worker ``slot`` means: the whole supervision policy.

    Only the task the worker had started (``current``, from its progress slot) is blamed; a
    task blamed ``POISON_DEATHS`` times becomes an error result for its batch and counts as
    progress of the slot. A slot replaced ``RESTARTS_WITHOUT_PROGRESS`` times in a row without
    progress means workers cannot be restored.

    Args:
        ledger: the pool's record of deaths and restarts (updated here).
        slot, pid, exitcode: the dead worker.
        current: the task number the worker was loading, or a negative value.
        unfinished: the numbers of the tasks it held, sorted.
        tasks: task number -> the task sent (for the poison message).
    """
    resend = list(unfinished)
    poisoned = None
    if current in resend and ledger.blame(current, exitcode) >= POISON_DEATHS:
        message = ledger.poison_message(current, tasks.get(current)) + _torch_words(pid, exitcode)
        poisoned = (current, error_result(PoisonSampleError(message)))
        resend.remove(current)
        ledger.progressed(slot)  # a poison verdict settles a task: that is progress
    broken = None
    if not ledger.restarted(slot):
        broken = (
            f"fastloader: DataLoader worker {slot} died again before delivering a batch "
            f"(pid {pid} {describe_exit(exitcode)}); workers cannot be restored. "
            "Every remaining batch of this epoch raises this error; the next epoch "
            "starts fresh workers."
        )
    return DeathVerdict(resend, poisoned, broken)


def warn_reseeded() -> None:
    """Warn once that a user's worker_init_fn seeded the global RNGs (it cannot reach samples)."""
    warnings.warn(
        "fastloader: worker_init_fn changed the global random states (for example torch's "
        "seed_worker recipe). fastloader seeds random, numpy.random and torch for every "
        "sample from (seed, epoch, index), so what worker_init_fn seeds does not reach "
        "dataset[i]; pass DataLoader(seed=...) to choose the seed instead.",
        RuntimeWarning,
        stacklevel=6,
    )


def stall_report(
    timeout: float,
    pids: list[int | None],
    held: dict[int, list[int]],
    progress: list[int] | None,
    tasks: dict[int, Any],
    stack_folder: str,
) -> str:
    """The error for ``timeout``, from the pool's state: asks busy workers for their stacks.

    Args:
        timeout: the DataLoader's timeout in seconds.
        pids: each slot's worker process id.
        held: slot -> numbers of the tasks it holds unfinished.
        progress: each slot's current task number (or NOT_STARTED), if supervised.
        tasks: task number -> the task sent.
        stack_folder: where workers write their stacks (NOTE [ Worker stacks on timeout ]).
    """
    holdings = {}
    for slot, pid in enumerate(pids):
        numbers = held.get(slot, [])
        current = progress[slot] if progress is not None else -1
        holdings[slot] = (
            pid,
            [tasks.get(n, n) for n in numbers],
            tasks.get(current) if current in numbers else None,
        )
    busy = [(slot, holding[0]) for slot, holding in holdings.items() if holding[1]]
    not_started = {
        slot for slot in holdings if progress is not None and progress[slot] == NOT_STARTED
    }
    return stall_message(timeout, holdings, dump_stacks(stack_folder, busy), not_started)


def _torch_words(pid: int | None, exitcode: int | None) -> str:
    """The last death in torch's own words, for code that matches torch's message."""
    if exitcode is None or exitcode >= 0:
        return ""
    name = signal.strsignal(-exitcode) or f"signal {-exitcode}"
    return f" (Last: DataLoader worker (pid {pid}) is killed by signal: {name}.)"


def stall_message(
    timeout: float,
    holdings: dict[int, tuple[int | None, list[Any], Any]],
    stacks: dict[int, str],
    not_started: set[int] | frozenset[int] = frozenset(),
) -> str:
    """The error for ``timeout``: which worker holds which indices, and its Python stack.

    Args:
        timeout: the DataLoader's timeout in seconds.
        holdings: slot -> (pid, unfinished tasks, the task it is loading or None).
        stacks: slot -> the text faulthandler dumped for that worker ("" if none).
        not_started: slots whose worker has not reached its start-up code yet.
    """
    lines = [f"DataLoader timed out after {timeout:g} seconds"]
    for slot, (pid, tasks, current) in sorted(holdings.items()):
        if not tasks:
            continue
        held = ", ".join(_describe_task(t) for t in tasks)
        lines.append(f"worker {slot} (pid {pid}) holds {held}")
        if slot in not_started:
            lines.append(
                "  it has not started: it never reached fastloader's start-up code (see "
                "NOTE [ Worker start-up ]: a forked worker can deadlock before it)"
            )
        if current is not None:
            lines.append(f"  it is loading {_describe_task(current)}")
        stack = stacks.get(slot, "").strip()
        if stack:
            lines.append(f"  Python stack of worker {slot}:")
            lines.extend("    " + line for line in stack.splitlines())
    return "\n".join(lines)


def _describe_task(task: Any) -> str:
    epoch = getattr(task, "epoch", None)
    indices = getattr(task, "indices", task)
    return f"indices {indices!r}" + ("" if epoch is None else f" (epoch {epoch})")


def dump_stacks(folder: str, workers: list[tuple[int, int]]) -> dict[int, str]:
    """Ask each (slot, pid) worker for its Python stack (NOTE [ Worker stacks on timeout ])."""
    files = {}
    for slot, pid in workers:
        path = stack_file(folder, slot, pid)
        if STACK_SIGNAL is None or path is None or not os.path.exists(path):
            continue  # a worker without the handler would die of the signal
        start = os.path.getsize(path)
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
        files[slot] = (path, start)
    stacks = {}
    deadline = time.monotonic() + 2.0
    for slot, (path, start) in files.items():
        text = ""
        while time.monotonic() < deadline and "File " not in text:
            time.sleep(0.05)
            with open(path) as file:
                file.seek(start)
                text = file.read()
        stacks[slot] = text
    return stacks


def release_orphaned_write_lock(result_queue: Any) -> None:
    """Release the result queue's write lock if a dead worker left it taken.

    A worker killed while writing a result leaves the multiprocessing queue's write lock taken
    and every other worker blocked behind it. Results are small (tensors travel through shared
    memory), and this runs after the queue stayed empty for a poll, so a lock still held half
    a second later is the dead worker's.
    """
    lock = getattr(result_queue, "_wlock", None)
    if lock is None:
        return
    if not lock.acquire(timeout=0.5):
        lock.release()
        return
    lock.release()
