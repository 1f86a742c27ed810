"""Child processes that die with their parent: the loader's workers and the packer's pool.

Runs in the child. Imports nothing heavy (the packer's workers must not import torch).
See NOTE [ Workers die with their parent ] in ``loader/worker_guard.py``: the kernel's parent-death
signal for a child forked from the main thread, a watcher process otherwise.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, forked_from_main_thread: bool = True) -> None:
    """Make this process exit soon after ``parent_pid`` dies (at once if it already has).

    See NOTE [ Workers die with their parent ]: the kernel's parent-death signal for a child
    forked from the parent's main thread; otherwise (a child forked from another thread, or
    started by a fork server) a watcher process that SIGKILLs this one when the parent exits,
    whatever this process's threads do with the GIL.
    """
    direct = os.getppid() == parent_pid
    if not direct and not process_runs(parent_pid):
        os._exit(1)  # the parent died before we got here
    _release_fork_server()
    if direct and forked_from_main_thread and _set_pdeathsig():
        if os.getppid() != parent_pid:  # died before the request took effect
            os._exit(1)
        return
    if not direct:
        _set_pdeathsig()  # die with the fork server too
    _start_watcher(parent_pid, direct)


def _release_fork_server() -> None:
    """Close this process's copy of the fork server's "alive" pipe (see the NOTE)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is None or getattr(server, "_forkserver_pid", None) is not None:
        return  # not a child of a fork server (its creator holds the pipe for good reason)
    with contextlib.suppress(OSError):
        os.close(alive)
    server._forkserver_alive_fd = None  # a fork server used from here starts its own


def _start_watcher(parent_pid: int, direct: bool) -> None:
    """Fork a watcher that SIGKILLs this process when ``parent_pid`` exits; a thread that
    polls where no process can be forked."""
    worker = os.getpid()
    handle = _pidfd(parent_pid)
    if (os.getppid() != parent_pid) if direct else not process_runs(parent_pid):
        os._exit(1)  # the parent died (the pid handle may name another process)
    try:
        pid = os.fork() if sys.platform.startswith("linux") else -1
    except OSError:
        pid = -1
    if pid == 0:  # the watcher: nothing but waiting, then the kill
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the worker
            if not _set_pdeathsig() or os.getppid() != worker:
                os._exit(0)  # it would outlive the worker; the worker keeps its thread
            _wait_for_exit(parent_pid, handle)
            os.kill(worker, signal.SIGKILL)
        finally:
            os._exit(0)
    if handle is not None:
        os.close(handle)
    if pid > 0:
        return
    thread = threading.Thread(
        target=_watch_parent, args=(parent_pid, direct), name="fastloader-parent-watch"
    )
    thread.daemon = True
    thread.start()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3, or not Linux
        return None


def _wait_for_exit(pid: int, handle: int | None) -> None:
    if handle is not None:
        select.select([handle], [], [])  # readable once the process has exited
        return
    while process_runs(pid):
        time.sleep(0.5)


def process_runs(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie has stopped running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or the process just ended
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, direct: bool) -> None:
    while os.getppid() == parent_pid if direct else process_runs(parent_pid):
        time.sleep(0.5)
    os._exit(1)
