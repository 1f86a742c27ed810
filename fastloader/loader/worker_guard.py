"""What runs in each worker process to keep it supervised: die with the parent, dump stacks.

NOTE [ Workers die with their parent ]

torch's workers notice a dead parent only between tasks, so a worker inside a long
``dataset[i]`` outlives a SIGKILLed main process. ``die_with_parent`` (``parent_death.py``)
covers each way a worker can be started, on Linux:

* forked or spawned from the main process's main thread: the worker asks the kernel for
  SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), then checks ``getppid()`` in case
  the parent died before the request. Nothing in the worker has to run: a worker stuck in C
  code holding the GIL dies too.
* forked or spawned from another thread: the kernel sends that signal when the *thread* that
  forked the worker exits, which would kill persistent workers when an iterating thread ends.
  So the worker forks a small watcher process instead, which waits on a pidfd of the main
  process (``pidfd_open``; polling where there is none) and SIGKILLs the worker when it exits.
  A thread in the worker could not do this: a ``__getitem__`` that holds the GIL (a C call
  that does not release it) would never let it run.
* started by a fork server (``forkserver``): the parent is the fork server, which exits only
  when every holder of its "alive" pipe has closed it, and multiprocessing hands that pipe's
  write end to every child it starts: the workers kept the server alive and the server kept
  the workers alive. So each worker closes its copy first (a fork server used from inside a
  worker starts its own), the fork server exits with the main process, the workers ask for the
  parent-death signal (their parent being the server) and start a watcher on the main process
  as well.

The watcher itself asks for the parent-death signal, so it never outlives its worker. Other
systems get a daemon thread in the worker that polls twice a second.

NOTE [ Worker stacks on timeout ]

Each worker registers ``faulthandler`` on SIGUSR2 to write its Python stack into its own file.
When ``timeout`` fires, the main process signals the workers that hold unfinished tasks and
puts their stacks in the error. On Linux the file is a memfd (``memfd_create``): it lives in
memory as long as the worker holds it, and the main process reads it through the worker's
``/proc/<pid>/fd``. Nothing is on disk, so a training process killed by SIGTERM or SIGKILL
(no finalizer runs) leaves nothing in the temp folder; a folder of files made by the main
process (``fastloader-stacks-*``, removed when the pool is collected) is the fallback where
there are no memfds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import shutil
import signal
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastloader.loader.result_queue import mark_writes
from fastloader.loader.seeding import SeededDataset, SeededIterableDataset
from fastloader.loader.transport.pipes import write_directly
from fastloader.parent_death import die_with_parent

STACK_SIGNAL = getattr(signal, "SIGUSR2", None)
_stack_files: list = []  # keeps the open stack file alive in this worker
#: ``stack_folder`` when the workers' stack files are memfds (NOTE [ Worker stacks on timeout ]).
IN_MEMORY = ""
_MEMFD_NAME = "fastloader-stack-{slot}"


def make_stack_folder(owner: Any) -> str:
    """Where ``owner``'s (a worker pool's) workers put their stacks: ``IN_MEMORY`` where
    memfds exist, else a temporary folder removed when ``owner`` is collected."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        return IN_MEMORY
    folder = tempfile.mkdtemp(prefix="fastloader-stacks-")
    weakref.finalize(owner, shutil.rmtree, folder, True)
    return folder


def stack_file(folder: str, slot: int, pid: int) -> str | None:
    """Where worker ``slot`` with process id ``pid`` writes its stack (None: nowhere yet)."""
    if folder != IN_MEMORY:
        return os.path.join(folder, f"worker-{slot}-{pid}.stack")
    fds = f"/proc/{pid}/fd"
    wanted = f"/memfd:{_MEMFD_NAME.format(slot=slot)} "  # the link reads "... (deleted)"
    try:
        for name in os.listdir(fds):
            with contextlib.suppress(OSError):
                if os.readlink(f"{fds}/{name}").startswith(wanted):
                    return f"{fds}/{name}"
    except OSError:
        pass
    return None


def _open_stack_file(folder: str, slot: int) -> Any:
    if folder != IN_MEMORY:
        return open(stack_file(folder, slot, os.getpid()), "w")  # noqa: SIM115 (kept open)
    return os.fdopen(os.memfd_create(_MEMFD_NAME.format(slot=slot), 0), "w")


def register_stack_dump(folder: str | None, slot: int) -> None:
    """Dump this worker's Python stack to its file on STACK_SIGNAL. See NOTE above."""
    if folder is None or STACK_SIGNAL is None:
        return
    try:
        file = _open_stack_file(folder, slot)
        faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=False)
        _stack_files.append(file)
    except (OSError, RuntimeError, ValueError):
        pass


#: In a worker: whether ``WorkerInit.on_start`` gave torch's loop a direct task reader.
tasks_read_directly = False


class WorkerInit:
    """Runs in each worker before the user's ``worker_init_fn``.

    Makes the worker die with its parent and dump its stack on request (NOTEs in
    loader/worker_guard.py), tells the seeded dataset its slot, and points
    ``get_worker_info().dataset`` back at the user's dataset, so code that configures the
    dataset per worker (sharding an iterable dataset, opening files) sees its own object.
    """

    def __init__(
        self,
        user_fn: Callable[[int], None] | None,
        parent_pid: int | None = None,
        stack_folder: str | None = None,
        reseeded: Any = None,
        writing: Any = None,
    ) -> None:
        self.user_fn = user_fn
        self.parent_pid = parent_pid
        self.stack_folder = stack_folder
        self.reseeded = reseeded  # shared flag, set when user_fn changed the global RNGs
        self.writing = writing  # shared flags: NOTE [ Torn results ] in loader/result_queue.py
        self.forked_from_main_thread = True
        # the pool's result queue, written without its feeder thread (NOTE [ Puts without a
        # feeder thread ] in loader/transport/pipes.py); the very object torch's loop puts on
        self.result_queue: Any = None
        # run first in the worker, from torch's loop (the pool's iterator sets it: reading the
        # loop's task queue directly, iterators/worker_loop.py); whether it did is kept in
        # ``tasks_read_directly``
        self.on_start: Callable[[], bool] | None = None

    def __call__(self, worker_id: int) -> None:
        global tasks_read_directly
        if self.parent_pid is not None:
            die_with_parent(self.parent_pid, self.forked_from_main_thread)
        if self.on_start is not None:
            tasks_read_directly = self.on_start()
        register_stack_dump(self.stack_folder, worker_id)
        if self.writing is not None:
            counted = mark_writes(self.writing, worker_id)
            if self.result_queue is not None:
                write_directly(self.result_queue, counted)
        info = get_worker_info()
        if isinstance(info.dataset, SeededDataset):
            info.dataset.slot = worker_id
            if info.dataset.progress is not None:  # started: NOTE [ Worker start-up ]
                info.dataset.progress[worker_id] = -1
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
