"""Shared-memory slots: one anonymous memory file per worker slot, a table of regions in it.

Used by both sides: the worker writes batches into regions (``send.py``), the main process
maps them as tensors and frees them (``receive.py``). See NOTE [ Batch transport ] in
``__init__.py`` for the design; this module is the memory and the table (and the dtype
conversions both sides make).

A file holds a header page (the table) and regions after it. Table row ``i`` is
``(state, offset, capacity, generation)``; ``state`` moves FREE -> WRITING -> READY in the
worker and READY -> FREE in the main process (when no tensor points into the region any more,
or when supervision reclaims the row of a dead worker that never sent it), so each side writes
only the transitions it owns and no lock is shared between processes. ``capacity == 0`` marks a
row that holds no region yet; ``generation`` counts the row's batches (a descriptor names it, so
a descriptor of a reclaimed row is known stale: NOTE [ Batch transport ], "Writing, and the
commit").
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

import numpy as np
import torch

FREE, WRITING, READY = 0, 1, 2
ROWS = 64  # regions per worker slot; past that, batches travel the old way (pickled)
HEADER_BYTES = mmap.PAGESIZE
COLUMNS = 4  # state, offset, capacity, generation
_END = ROWS * COLUMNS  # the int64 after the table: where the next region starts
PAGE = mmap.PAGESIZE


def round_up(size: int, to: int = PAGE) -> int:
    """``size`` rounded up to a multiple of ``to``."""
    return -(-size // to) * to


def anonymous_file() -> int:
    """A file descriptor of shared memory that has no name anywhere: nothing to clean up
    after any death (Linux ``memfd_create``; elsewhere a file unlinked as soon as made)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("fastloader-slots", os.MFD_CLOEXEC)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="fastloader-slots-", dir=folder)
    os.unlink(path)
    return fd


class SlotFile:
    """One worker slot's shared memory, as seen by the process that holds ``fd``."""

    def __init__(self, fd: int, create: bool = False) -> None:
        self.fd = fd
        if create:
            os.ftruncate(fd, HEADER_BYTES)
        self._header = mmap.mmap(fd, HEADER_BYTES)
        words = np.frombuffer(self._header, dtype=np.int64, count=_END + 1)
        # rows of (state, offset, capacity, generation)
        self.table = words[:_END].reshape(ROWS, COLUMNS)
        # the same words for reading one at a time (a third of indexing ``table``)
        self.words = memoryview(self._header).cast("q")
        self._end = words[_END:]
        if create:
            self._end[0] = HEADER_BYTES
        self._maps: dict[int, tuple[int, int, mmap.mmap]] = {}  # row -> offset, capacity, map
        self.hint = 0  # the row ``acquire`` tries first (worker)
        # main process: row -> (address, bytes used) of the batches that hold it (receive.rebuild);
        # rows kept READY for good (a forked child that may still read them: forks.py)
        self.live: dict[int, tuple[int, int]] = {}
        self.pinned: set[int] = set()

    @classmethod
    def create(cls) -> SlotFile:
        """A new, empty slot file (in the main process, before workers start)."""
        return cls(anonymous_file(), create=True)

    def region(self, row: int, offset: int, capacity: int) -> mmap.mmap:
        """This process's mapping of ``row``'s region, at ``offset`` (made once per region)."""
        cached = self._maps.get(row)
        if cached is not None and cached[0] == offset and cached[1] == capacity:
            return cached[2]
        mapping = mmap.mmap(self.fd, capacity, offset=offset)
        self._maps[row] = (offset, capacity, mapping)  # an old one lives on while exported
        return mapping

    def place(self, row: int, capacity: int) -> None:
        """Give ``row`` a new region of ``capacity`` bytes at the end of the file (worker).
        The row's old region, if any, is handed back to the system first."""
        old = self._maps.pop(row, None)
        if old is not None:
            _release(old[2])
        offset = int(self._end[0])
        os.ftruncate(self.fd, offset + capacity)
        self.table[row, 1] = offset
        self.table[row, 2] = capacity
        self._end[0] = offset + capacity

    def free(self, row: int) -> None:
        """Hand ``row`` back to its worker (main process, when no tensor points into it)."""
        self.table[row, 0] = FREE

    def close(self) -> None:
        """Close this process's descriptor (mappings in use stay valid)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def bytes_in_use(self) -> int:
        """Bytes of shared memory held by regions."""
        return int(self.table[:, 2].sum())


def _release(mapping: mmap.mmap) -> None:
    # frees the memory of a region no longer used (shared memory: MADV_REMOVE punches a hole)
    advice = getattr(mmap, "MADV_REMOVE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass


def acquire(slots: SlotFile, size: int) -> int | None:
    """In the worker: a row whose region holds ``size`` bytes, marked WRITING; ``None`` when
    every row is in use (the caller sends the batch the old way)."""
    table = slots.table
    row = slots.hint
    # first the row after the last one taken: a training loop frees rows in the order they
    # were taken, so in steady state that one is free and fits (no search of the table); only
    # a tight fit, as a region grown for this size would be (else a small batch could take a
    # big region and the next big batch grow another: ragged batches, twice the memory)
    capacity = table[row, 2]
    if not (table[row, 0] == FREE and size <= capacity <= round_up(size + size // 8)):
        states = table[:, 0]
        capacities = table[:, 2]
        free = np.flatnonzero(states == FREE)
        if free.size == 0:
            return None
        fits = free[capacities[free] >= size]
        if fits.size:
            row = int(fits[np.argmin(capacities[fits])])
        else:  # grow: the biggest free region too small is handed back for a bigger one;
            # a row never used only when every region is in use (batches that grow would
            # otherwise leave a region of each size behind: ROWS regions)
            placed = free[capacities[free] > 0]
            row = int(placed[np.argmax(capacities[placed])]) if placed.size else int(free[0])
            slots.place(row, round_up(size + size // 8))
    table[row, 0] = WRITING
    table[row, 3] += 1  # a new batch in this row: a descriptor of the last one is stale
    slots.hint = row + 1 if row + 1 < ROWS and table[row + 1, 2] else 0
    return row


def reclaim_torn(slots: SlotFile) -> None:
    """In a (replacement) worker at start: rows a dead worker was writing are free again;
    their batches were never sent (NOTE [ Batch transport ], the commit protocol)."""
    states = slots.table[:, 0]
    states[states == WRITING] = FREE


def reduce_fd(fd: int) -> Any:
    """``fd`` in a form that crosses to a spawned or forkserver child (multiprocessing's
    ``DupFd``); a forked child inherits it as is."""
    from multiprocessing import context, reduction

    if context.get_spawning_popen() is None:
        return fd
    return reduction.DupFd(fd)


def restore_fd(value: Any) -> int:
    """The file descriptor ``reduce_fd`` gave, in this process."""
    return value if isinstance(value, int) else value.detach()


# -- dtypes, as both sides convert them ---------------------------------------------------

_TORCH_DTYPES: dict[np.dtype, Any] = {}
_NUMPY_DTYPES: dict[Any, np.dtype | None] = {}


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a NumPy dtype (as ``torch.from_numpy`` gives it)."""
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return found


def numpy_dtype(dtype: Any) -> np.dtype | None:
    """The NumPy dtype of a torch dtype, or None where NumPy has none (bfloat16, float8...)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        pass
    try:
        found = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        found = None
    _NUMPY_DTYPES[dtype] = found
    return found
