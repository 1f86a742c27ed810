"""The packer's processes and partial files: workers that die with the packer, a fork that does
not copy the parent's heap, and the removal of partial files left by killed runs.

The pool initializer runs in the worker processes; everything else in the main process
(NOTE [ Packer processes ] below; NOTE [ Atomic packing ] in packing.py).
"""

from __future__ import annotations

import contextlib
import errno
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

from fastloader._pack_worker import Encoded, start_worker
from fastloader._parent_death import die_with_parent, process_runs
from fastloader.formats.metadata import human_size

# NOTE [ Signals while packing ]
# A scheduler's time limit (or `kill`) sends SIGTERM; the CLI handles it like Ctrl-C: within
# `signals_as_interrupts()`, SIGTERM raises Terminated (a KeyboardInterrupt) and SIGINT raises
# KeyboardInterrupt, so pack() cleans up (NOTE [ Atomic packing ]). But an exception raised
# by a signal handler is lost when it lands where Python ignores exceptions: in an at-fork hook
# (seen: logging's, while the pool forks its workers), a __del__, a weakref callback. So the
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
# The death signal follows the *thread* that started the worker: the pool (_pack_pool.py)
# starts its workers, replacements included, from the thread that runs pack(), which lives
# until they are stopped.


def start_pool_worker(encoder: Callable[[Any], Encoded], parent: int) -> None:
    """In a new worker: die with the parent, leave SIGTERM to it, then set up the encoder."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent)
    start_worker(encoder)


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


# NOTE [ Publishing the pack ]
# The pack is written to a partial file and renamed to DST at the end (NOTE [ Atomic packing ]
# in packing.py). DST is checked at the start, but a run takes minutes: another packer (or
# anything) may create DST meanwhile, and a plain rename would silently replace it, both runs
# reporting success. So the final step depends on --overwrite:
# * without it, the rename must fail if DST exists, atomically (a check then a rename races):
#   renameat2(RENAME_NOREPLACE) (Linux 3.15+; ext4, xfs, btrfs, tmpfs, ...), called through
#   ctypes; where the libc or the file system lacks it, a hard link to DST (link(2) never
#   replaces; then the partial name is removed); where the file system has no hard links
#   either, an exclusive flock on DST's folder around "check, then rename": atomic among
#   fastloader packers only. Two packers racing for one DST: exactly one wins, the other
#   exits with FileExistsError and removes its partial file.
# * with it, DST is replaced, and when DST is not the file that was there at the start (it
#   appeared, or was rewritten: another device, inode, size or mtime), the summary says so.

_RENAME_NOREPLACE = 1  # from <linux/fs.h>
_AT_FDCWD = -100
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """What tells one file at ``path`` from another written there later, or None if absent."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def publish(partial: Path, target: Path, overwrite: bool, seen: tuple | None) -> str | None:
    """Rename the finished ``partial`` file to ``target`` (see NOTE [ Publishing the pack ]).

    Args:
        partial: the complete pack, beside ``target``.
        target: DST.
        overwrite: replace ``target`` if it exists.
        seen: ``file_identity(target)`` at the start of the run.

    Returns:
        a line for the user when ``overwrite`` replaced a ``target`` that appeared or changed
        during the run, else None.

    Raises:
        FileExistsError: without ``overwrite``, if ``target`` exists now.
    """
    if overwrite:
        now = file_identity(target)
        os.replace(partial, target)
        if now is None or now == seen:
            return None
        how = "appeared" if seen is None else "changed"
        return f"replaced {target}, which {how} while this run packed (--overwrite)"
    try:
        rename_noreplace(partial, target)
    except FileExistsError:
        raise FileExistsError(
            f"{target}: appeared while packing (another packer?); left as it is and this run's "
            "pack discarded (use --overwrite to replace it)"
        ) from None
    return None


def rename_noreplace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically, failing if ``target`` exists.

    Raises:
        FileExistsError: if ``target`` exists.
        OSError: if the rename fails otherwise.
    """
    if _renameat2(source, target):
        return
    try:
        os.link(source, target)
    except FileExistsError:
        raise
    except OSError as error:
        if error.errno not in _UNSUPPORTED | {errno.EPERM, errno.EMLINK}:
            raise
    else:
        os.remove(source)
        return
    _locked_rename(source, target)


def _renameat2(source: Path, target: Path) -> bool:
    """renameat2(RENAME_NOREPLACE); False where the libc or the file system lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl before 1.2.2
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    paths = os.fsencode(source), os.fsencode(target)
    if call(_AT_FDCWD, paths[0], _AT_FDCWD, paths[1], _RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), os.fspath(source), None, os.fspath(target))


def _locked_rename(source: Path, target: Path) -> None:
    """Check, then rename, under an exclusive flock of the folder: atomic among packers."""
    import fcntl

    folder = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(target))
        os.rename(source, target)
    finally:
        os.close(folder)  # releases the lock


# NOTE [ Disk full while packing ]
# A full disk surfaces differently per backend: HDF5 raises OSError with ENOSPC; LMDB raises
# `lmdb.Error: mdb_txn_commit: Input/output error` (it maps a short write to EIO) with no
# errno at all. Both become one DiskFullError naming DST's file system (its mount point and
# device), the space free when the run started and the space the pack needs, estimated from
# the bytes of the records written so far; the partial file is removed as for any failure
# (NOTE [ Atomic packing ]). An EIO counts as a full disk only when the file system has less
# than _FULL_MARGIN free at that moment (a short write on a nearly full disk); an EIO with room
# to spare is a real I/O error and is raised as it is. A file size limit (`ulimit -f`, or the
# file system's largest file: EFBIG) gets its own one line.

_FULL_MARGIN = 128 << 20  # twice the LMDB writer's commit size


class DiskFullError(OSError):
    """The pack did not fit on DST's file system (or under a file size limit)."""

    def __str__(self) -> str:
        return str(self.strerror)  # one line, without "[Errno 28]"


def free_bytes(folder: Path) -> int | None:
    """Bytes free to this user on the file system holding ``folder``."""
    try:
        stat = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def _file_system(folder: Path) -> str:
    """``MOUNT (DEVICE)``: the mount point of the file system holding ``folder``."""
    path = os.path.realpath(folder)
    try:
        device = os.stat(path).st_dev
        while path != os.path.dirname(path) and os.stat(os.path.dirname(path)).st_dev == device:
            path = os.path.dirname(path)
        with open("/proc/self/mounts") as mounts:
            sources = [line.split()[0] for line in mounts if line.split()[1:2] == [path]]
    except (OSError, IndexError):
        return path
    return f"{path} ({sources[-1]})" if sources else path


def storage_error(
    error: BaseException, target: Path, written: int, records: int, total: int, free: int | None
) -> DiskFullError | None:
    """The one-line error for a pack that ran out of disk (see NOTE [ Disk full ... ]), or None
    when ``error`` is something else.

    Args:
        error: what the writer raised.
        target: DST.
        written: bytes of records written so far; ``records``: how many.
        total: the number of samples to pack.
        free: ``free_bytes`` of DST's folder when the run started.
    """
    code = getattr(error, "errno", None)
    text = " ".join(str(error).split())
    if code == errno.EFBIG or "File too large" in text:
        return DiskFullError(
            errno.EFBIG,
            f"{target}: the pack grew past the largest file allowed here (ulimit -f, or the "
            f"limit of {_file_system(target.parent)}) after {human_size(written)}",
        )
    full = code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text
    if not full and (code == errno.EIO or "Input/output error" in text):
        now = free_bytes(target.parent)
        full = now is not None and now < _FULL_MARGIN
    if not full:
        return None
    need = "it is full"
    if records:
        estimate = human_size(written * total / records)
        need = f"the pack needs more than {estimate} (from {records} of {total} records written)"
    have = "" if free is None else f", {human_size(free)} were free at the start"
    return DiskFullError(
        errno.ENOSPC,
        f"{target}: no space left on {_file_system(target.parent)}: {need}{have}; free some "
        "space there or write DST elsewhere",
    )
