"""What runs in each worker process to keep it supervised: die with the parent, dump stacks.

NOTE [ Workers die with their parent ]

torch's workers notice a dead parent only between tasks, so a worker inside a long
``dataset[i]`` outlives a SIGKILLed main process. On Linux each worker asks the kernel for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), then checks ``getppid()`` in case
the parent died before the request. The kernel sends that signal when the *thread* that forked
the worker exits, so it is used only when the worker was started from the main thread;
otherwise, and on other systems, a daemon thread polls ``getppid()`` twice a second.

NOTE [ Worker stacks on timeout ]

Each worker registers ``faulthandler`` on SIGUSR2 to write its Python stack into its own file
in a folder the main process made. When ``timeout`` fires, the main process signals the
workers that hold unfinished tasks and puts their stacks in the error.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastloader.seeding import SeededDataset, SeededIterableDataset

_PR_SET_PDEATHSIG = 1
STACK_SIGNAL = getattr(signal, "SIGUSR2", None)
_stack_files: list = []  # keeps the open stack file alive in this worker


def die_with_parent(parent_pid: int, forked_from_main_thread: bool) -> None:
    """Make this process exit soon after ``parent_pid`` dies. See NOTE above."""
    direct = os.getppid() == parent_pid
    if not direct and not _alive(parent_pid):
        os._exit(1)  # the parent died before we got here
    # Not a direct child under the "forkserver" start method: the fork server is the parent,
    # and it exits when the main process does, so the parent-death signal still applies.
    linux = sys.platform.startswith("linux")
    if linux and (forked_from_main_thread or not direct) and _set_pdeathsig():
        if os.getppid() != parent_pid and direct:
            os._exit(1)
        return
    thread = threading.Thread(
        target=_watch_parent, args=(parent_pid, direct), name="fastloader-parent-watch"
    )
    thread.daemon = True
    thread.start()


def _set_pdeathsig() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_parent(parent_pid: int, direct: bool) -> None:
    while os.getppid() == parent_pid if direct else _alive(parent_pid):
        time.sleep(0.5)
    os._exit(1)


def stack_file(folder: str, slot: int, pid: int) -> str:
    """Where worker ``slot`` with process id ``pid`` writes its stack."""
    return os.path.join(folder, f"worker-{slot}-{pid}.stack")


def register_stack_dump(folder: str | None, slot: int) -> None:
    """Dump this worker's Python stack to its file on STACK_SIGNAL. See NOTE above."""
    if folder is None or STACK_SIGNAL is None:
        return
    try:
        file = open(stack_file(folder, slot, os.getpid()), "w")  # noqa: SIM115 (kept open)
        faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=False)
        _stack_files.append(file)
    except (OSError, RuntimeError, ValueError):
        pass


class WorkerInit:
    """Runs in each worker before the user's ``worker_init_fn``.

    Makes the worker die with its parent and dump its stack on request (NOTEs in
    _worker_guard.py), tells the seeded dataset its slot, and points
    ``get_worker_info().dataset`` back at the user's dataset, so code that configures the
    dataset per worker (sharding an iterable dataset, opening files) sees its own object.
    """

    def __init__(
        self,
        user_fn: Callable[[int], None] | None,
        parent_pid: int | None = None,
        stack_folder: str | None = None,
        reseeded: Any = None,
    ) -> None:
        self.user_fn = user_fn
        self.parent_pid = parent_pid
        self.stack_folder = stack_folder
        self.reseeded = reseeded  # shared flag, set when user_fn changed the global RNGs
        self.forked_from_main_thread = True

    def __call__(self, worker_id: int) -> None:
        if self.parent_pid is not None:
            die_with_parent(self.parent_pid, self.forked_from_main_thread)
        register_stack_dump(self.stack_folder, worker_id)
        info = get_worker_info()
        if isinstance(info.dataset, SeededDataset):
            info.dataset.slot = worker_id
        if isinstance(info.dataset, (SeededDataset, SeededIterableDataset)):
            object.__setattr__(info, "dataset", info.dataset.dataset)
        if self.user_fn is None:
            return
        if self.reseeded is None or worker_id != 0:
            self.user_fn(worker_id)
            return
        before = _rng_fingerprint()
        self.user_fn(worker_id)
        if _rng_fingerprint() != before:
            self.reseeded.value = 1  # the main process warns (a worker's warnings may be lost)


def _rng_fingerprint() -> tuple:
    numpy_state = np.random.get_state()
    return (
        random.getstate(),
        numpy_state[1].tobytes(),
        numpy_state[2],
        torch.get_rng_state().numpy().tobytes(),
    )
