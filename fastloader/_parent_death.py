"""Child processes that die with their parent: the loader's workers and the packer's pool.

Runs in the child. Imports nothing heavy (the packer's workers must not import torch).
See NOTE [ Workers die with their parent ] in ``_worker_guard.py`` for why the kernel's
parent-death signal is used only for a child forked from the main thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, forked_from_main_thread: bool = True) -> None:
    """Make this process exit soon after ``parent_pid`` dies (at once if it already has).

    On Linux, for a child forked from the parent's main thread (or started by a fork server,
    which exits with the main process), the kernel sends SIGKILL when the parent dies;
    otherwise a daemon thread checks twice a second.
    """
    direct = os.getppid() == parent_pid
    if not direct and not process_runs(parent_pid):
        os._exit(1)  # the parent died before we got here
    if (forked_from_main_thread or not direct) and _set_pdeathsig():
        if direct and os.getppid() != parent_pid:  # died before the request took effect
            os._exit(1)
        return
    thread = threading.Thread(
        target=_watch_parent, args=(parent_pid, direct), name="fastloader-parent-watch"
    )
    thread.daemon = True
    thread.start()


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
