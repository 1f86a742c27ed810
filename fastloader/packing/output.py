"""The end of a pack: the partial file renamed to DST without replacing a DST that appeared
meanwhile, and a full disk turned into one line naming it.

Runs in the packer's main process (packing/pack.py), after the writer closed or failed.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from fastloader.formats.metadata import human_size

# NOTE [ Publishing the pack ]
# The pack is written to a partial file and renamed to DST at the end (NOTE [ Atomic packing ]
# in packing/pack.py). DST is checked at the start, but a run takes minutes: another packer (or
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
    """The one-line error for a pack that ran out of disk, or None when ``error`` is something
    else. See NOTE [ Disk full while packing ].

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
