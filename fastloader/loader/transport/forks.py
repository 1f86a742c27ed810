"""A batch inherited by a forked child keeps its values: the child's copy of its memory is
made private at the fork.

Runs at every ``os.fork`` of a process that holds batches (the hooks are registered when this
module is imported); see NOTE [ Batch transport ], "A batch in another process", in
``__init__.py``. The parent waits until the child has copied; without batches held, a fork
costs a dictionary walk more than before, and a process that holds none pays nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import threading
from collections.abc import Iterator

from fastloader.loader.transport import receive
from fastloader.loader.transport.slots import round_up

#: how long a parent waits for its child to copy; past it, the rows stay held for good
COPY_WAIT_S = 30.0

_local = threading.local()  # ``quiet``: forks of this thread are the pool's own workers
_pending: tuple[list, list, int, int] | None = None  # at a fork: (rows, regions, read, write)


@contextlib.contextmanager
def workers_starting() -> Iterator[None]:
    """Forks made inside this block are workers of a pool: they never read a batch of this
    process, so the batches it holds are not copied for them."""
    _local.quiet = getattr(_local, "quiet", 0) + 1
    try:
        yield
    finally:
        _local.quiet -= 1


def _held() -> tuple[list, list]:
    # the rows of batches this process holds, and their memory: (slot file, row), (address,
    # bytes); a snapshot taken under the rows lock
    rows, regions = [], []
    for files in list(receive._registry.values()):
        for slots in files:
            for row, (address, size) in list(slots.live.items()):
                rows.append((slots, row))
                regions.append((address, round_up(size)))
    return rows, regions


def _before_fork() -> None:
    global _pending
    _pending = None
    if getattr(_local, "quiet", 0):
        return
    receive.rows_lock.acquire()  # no row is taken or reclaimed across the fork
    rows, regions = _held()
    if regions:
        read, write = os.pipe()
        _pending = (rows, regions, read, write)


def _after_in_parent() -> None:
    global _pending
    pending, _pending = _pending, None
    if getattr(_local, "quiet", 0):
        return
    receive.rows_lock.release()
    if pending is None:
        return
    rows, _regions, read, write = pending
    os.close(write)
    try:
        waiting = select.poll()
        waiting.register(read, select.POLLIN)
        answer = os.read(read, 1) if waiting.poll(COPY_WAIT_S * 1000) else None
    finally:
        os.close(read)
    # b"1": copied; b"": no child (a failed fork) or a dead one; else it may still read the
    # shared memory: those rows are never freed
    if answer not in (b"1", b""):
        for slots, row in rows:
            slots.pinned.add(row)


def _after_in_child() -> None:
    global _pending
    pending, _pending = _pending, None
    receive.rows_lock = threading.Lock()  # (the parent's may be held by another thread)
    for files in receive._registry.values():
        for slots in files:
            slots.live.clear()  # this process frees no row (receive._free): nothing to track
    if pending is None:
        return
    _rows, regions, read, write = pending
    os.close(read)
    try:
        for address, size in regions:
            _make_private(address, size)
        os.write(write, b"1")
    except Exception:  # the parent keeps these rows for good
        os.write(write, b"0")
    finally:
        os.close(write)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP = getattr(_libc, "mremap", None)
if _MREMAP is not None:
    _MREMAP.restype = ctypes.c_void_p
    _MREMAP.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2  # Linux
_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _make_private(address: int, size: int) -> None:
    """Replace the shared pages at ``address`` by private ones holding the same bytes."""
    copy = _libc.mmap(None, size, _RW, _PRIVATE, -1, 0)
    if copy in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap")
    ctypes.memmove(copy, address, size)
    if _MREMAP is not None:  # the copy moved over the shared pages at once
        moved = _MREMAP(copy, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
        if moved == address:
            return
    # elsewhere: private pages over the shared ones, then the bytes back
    placed = _libc.mmap(address, size, _RW, _PRIVATE | _FIXED, -1, 0)
    if placed != address:
        raise OSError(ctypes.get_errno(), "mmap")
    ctypes.memmove(address, copy, size)
    _libc.munmap(ctypes.c_void_p(copy), ctypes.c_size_t(size))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child
    )
