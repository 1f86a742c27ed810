"""The packer's processes and partial files: workers that die with the packer, a fork that does
not copy the parent's heap, and the removal of partial files left by killed runs.

``start_pool_worker`` runs in the worker processes; everything else in the main process
(NOTE [ Packer processes ] below; NOTE [ Atomic packing ] in packing/pack.py). The pool itself is in
``packing/pool.py``, the end of the output file in ``packing/output.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastloader.packing.worker import Encoded, start_worker
from fastloader.parent_death import die_with_parent, process_runs

# NOTE [ Signals while packing ]
# A scheduler's time limit (or `kill`) sends SIGTERM; the CLI handles it like Ctrl-C: within
# `signals_as_interrupts()`, SIGTERM raises Terminated (a KeyboardInterrupt) and SIGINT raises
# KeyboardInterrupt, so pack() cleans up (NOTE [ Atomic packing ]). But an exception raised
# by a signal handler is lost when it lands where Python ignores exceptions: in an at-fork hook
# (seen: logging's, while the pool forks its workers), a __del__, a weakref callback. Forks are
# therefore made with both signals held (`signals_held()`), and the
# handler also records the signal, and pack() calls `raise_if_signalled()` after each record
# and before the final rename: a lost exception is raised again at the next record. During the
# clean-up a second SIGTERM is ignored (the clean-up is short) and a second Ctrl-C interrupts
# it as usual; SIGKILL still ends it all.


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a scheduler's time limit, ``kill``): handled like Ctrl-C."""


_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: int | None = None  # the signal that arrived within signals_as_interrupts()


def raise_if_signalled() -> None:
    """Raise again what SIGTERM or SIGINT raised in ``signals_as_interrupts()``, if it came."""
    if _received == signal.SIGTERM:
        raise Terminated
    if _received == signal.SIGINT:
        raise KeyboardInterrupt


def _handler(signum: int, frame: Any) -> None:
    global _received
    _received = signum
    if signum == signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise KeyboardInterrupt


@contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` and SIGINT KeyboardInterrupt, both
    also recorded for :func:`raise_if_signalled` (see NOTE [ Signals while packing ]).

    Does nothing outside the main thread (Python delivers signals there only) or on Windows.
    """
    global _received
    if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = None
    previous = {number: signal.signal(number, _handler) for number in _SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _received = None


# NOTE [ Forking the packer's workers ]
# Forked workers share the parent's memory until they write to it, and the garbage collector
# writes to every object it visits. With torch imported that is millions of objects: the first
# collection in each worker copied their pages, which took 0.5-1 s of a 16-image pack on the
# shared 2-core box (benchmarks/cli_startup.py). So the parent freezes its heap (gc.freeze():
# the collector skips those objects, in the workers too) while the first submit forks the
# workers, and unfreezes it once they exist. (Python's gc docs recommend this for fork.)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# NOTE [ Packer processes ]
# The packer must never leave a process or a file behind, however it ends:
# * Ctrl-C (SIGINT to the whole process group) and SIGTERM (a scheduler's time limit, `kill`;
#   the CLI turns it into an exception like Ctrl-C): pool workers ignore both, the main process
#   handles them once: it stops the workers (idle ones are told to exit, busy ones are
#   SIGKILLed: they hold nothing but the images at hand), removes the partial file and exits
#   (130 / 143).
# * SIGKILL of the main process (the OOM killer, a scheduler's last resort): nothing runs in
#   it, so each worker asks the kernel to SIGKILL it when its parent dies (Linux
#   PR_SET_PDEATHSIG, set when the worker starts, then a getppid() check for a parent that
#   died before that); elsewhere a watchdog thread in each worker polls getppid(). The partial
#   file stays; the next run for the same DST removes it (see NOTE [ Atomic packing ]).
# The death signal follows the *thread* that started the worker: the pool (packing/pool.py)
# starts its workers, replacements included, from the thread that runs pack(), which lives
# until they are stopped.


def start_pool_worker(encoder: Callable[[Any], Encoded], parent: int) -> None:
    """In a new worker: die with the parent, leave SIGTERM to it, then set up the encoder."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent)
    start_worker(encoder)  # ignores SIGINT: Ctrl-C is the packer's to handle
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)  # held by signals_held()


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT while a worker is forked; they arrive just after.

    See NOTE [ Signals while packing ]: a handler's exception raised inside an at-fork hook is
    lost and printed as "Exception ignored in ...". Held, the signal is delivered when the
    block ends, in ordinary code. The child starts with them held and releases them itself
    (``start_pool_worker``), after it chose to ignore them.
    """
    if not hasattr(signal, "pthread_sigmask") or (
        threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_PARTIAL = re.compile(r"\.partial-(?P<pid>\d+)(?:@(?P<host>.+))?$")


def partial_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.partial-{os.getpid()}@{socket.gethostname()}")


def remove_stale_partials(target: Path) -> list[tuple[Path, int]]:
    """Remove the partial files of ``target`` left by dead packer processes of this host."""
    prefix, host, removed = f".{target.name}", socket.gethostname(), []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        match = _PARTIAL.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is None or match["host"] not in (None, host):
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and process_runs(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(target.parent / name)
            if pid != os.getpid():  # our own pid: a run before a reboot; nothing to report
                removed.append((target.parent / name, pid))
    return removed
