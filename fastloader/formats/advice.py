"""Read advice for a pack's memory map: what the kernel reads ahead, and what it reads early.

Runs in whichever process reads a pack (the main process, or each DataLoader worker). Torch-free
and self-contained, like everything in ``fastloader.formats``.

NOTE [ Read advice for packs bigger than memory ]
Records are sliced from fastloader's own read-only map of the pack (NOTE [ Record spans ] in
lmdb_checks.py, NOTE [ Contiguous HDF5 records ] in hdf5.py). When the pack is not in the page
cache, touching a record faults, and a fault on a file map reads the disk's read-ahead window
around it (``read_ahead_kb``: 128 KB by default, 8 MB on some RAID, network and cloud disks),
one fault at a time. In a random order most of that window is other records, never used before
it is evicted: issue 23 measured 6 MB read per 260 KB record, 10x slower than the folder the
pack replaced. Two pieces of advice fix it, both decided per process from the indices it reads:

1. **Random or sequential.** Each batch's positions tell how the order runs: a step to the next
   record or a few ahead is sequential, anything else random. When most recent steps are
   random the map is advised ``MADV_RANDOM`` (a fault reads only its own pages); when they turn
   sequential again it goes back to ``MADV_NORMAL`` (the kernel's read-ahead, the fastest way
   through a pack in order). A pack in the page cache costs nothing either way.
2. **The batch ahead of its reads.** Before a batch is read, the byte range of each of its
   records (page-aligned) is advised ``MADV_WILLNEED``: the kernel queues every record's reads
   at once, so the disk sees a deep queue instead of one fault at a time, and the faults that
   follow wait on reads already in flight. The kernel caps one WILLNEED call at its read-ahead
   size (``max(io_pages, ra_pages)`` pages), so ranges are advised in chunks of at most
   ``_CHUNK`` bytes (the smallest usual read-ahead). LMDB finds a record through its B-tree
   leaf, walked one page at a time: the first time a branch page is walked, all its children
   are asked for together (``willneed_pages``), else a first pass over small records waits for
   one leaf read per sample.

None of it applies to a pack that fits in the page cache with room to spare (up to half the
memory available to this process's page cache: ``memory_for_cache``, cgroup limits included):
there the read-ahead window's other records stay cached until they are read, so the kernel's
large reads are the fastest way through a cold pack, and a warm one needs no advice.

Nothing here changes which bytes are read as a record, nor their checksums: advice only says
when pages come in. It is best effort: a map or platform without ``madvise`` reads as before.
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    resource = None  # type: ignore[assignment]

_PAGE = mmap.PAGESIZE
_CHUNK = 128 << 10  # Linux's default read_ahead_kb: one WILLNEED call is capped near it
_NEAR = 64  # a step of 1.._NEAR records forward counts as sequential (workers interleave)
_WINDOW = 128  # the steps the order is judged over (two batches of 64)
_SEQUENTIAL_SHARE = 0.5  # at least this share of sequential steps: read-ahead stays on
_CACHED_BATCHES = 4  # batches whose WILLNEED read nothing before it is paused
_FITS_SHARE = 0.5  # a map up to this share of the memory left for the page cache: no advice

_HAS_MADVISE = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_RANDOM")
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def _thread_major_faults() -> int | None:
    """Major page faults of the calling thread (faults that waited for storage), if known."""
    if _RUSAGE_THREAD is None:
        return None
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt


def _thread_read_bytes() -> int | None:
    """Bytes the calling thread had read from storage (``/proc/thread-self/io``), if known."""
    try:
        with open("/proc/thread-self/io", "rb") as file:
            for line in file:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_for_cache() -> int | None:
    """Bytes the page cache can hold for this process: ``MemAvailable`` of /proc/meminfo,
    lowered to the smallest limit of the memory cgroups above it (v1 ``memory.limit_in_bytes``
    or v2 ``memory.max``, every level); None where none of it can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo", "rb") as file:
            for line in file:
                if line.startswith(b"MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as file:
            lines = file.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            found += _cgroup_limits(Path("/sys/fs/cgroup"), path, "memory.max")
        elif "memory" in controllers.split(","):
            found += _cgroup_limits(Path("/sys/fs/cgroup/memory"), path, "memory.limit_in_bytes")
    return min(found) if found else None


def _cgroup_limits(root: Path, path: str, name: str) -> list[int]:
    limits = []
    group = root / path.lstrip("/")
    for folder in (group, *group.parents):
        try:
            text = (folder / name).read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            limits.append(int(text))
        if folder == root:
            break
    return limits


# NOTE [ WILLNEED only while reads miss ]
# A pack in the page cache needs no WILLNEED: each call still walks the page cache for every
# page of the range, and for small records the calls cost more than the reads (measured: a
# fifth of the throughput of 136-byte records). So WILLNEED pauses itself: when the bytes this
# thread read from storage (/proc/thread-self/io, counted as the kernel submits the reads, so
# before madvise returns) did not move over a batch's WILLNEED calls for _CACHED_BATCHES
# batches, the pack is cached. While paused, the thread's major faults (getrusage: a fault that
# waited for storage, 1 us to read) tell when reads miss again, and WILLNEED resumes with the
# next batch. Where neither counter can be read, WILLNEED stays on.


class ReadAdvice:
    """Advice for one memory map, from the positions one process reads (see NOTE [ Read advice
    for packs bigger than memory ]).

    Holds no reference to the map (so a dataset holding one still pickles); the caller passes
    the map with each call, and makes a new ``ReadAdvice`` for a new map.

    Args:
        willneed: advise each batch's record ranges ``MADV_WILLNEED`` before they are read.
        random_access: advise the map ``MADV_RANDOM`` while the order is random.
    """

    def __init__(self, *, willneed: bool = True, random_access: bool = True) -> None:
        self.willneed = willneed
        self.random_access = random_access
        self.random = False  # whether MADV_RANDOM is in force on the map
        self.willneed_paused = False  # see NOTE [ WILLNEED only while reads miss ]
        self.bigger_than_memory: bool | None = None  # decided at the first read
        self._batches: deque[tuple[int, int]] = deque()  # (steps, sequential steps) per call
        self._steps = 0
        self._sequential = 0
        self._last: int | None = None
        self._cached_batches = 0
        self._faults = _thread_major_faults()

    def observe(self, positions: Sequence[int]) -> bool:
        """Record the positions about to be read; return whether the order looks random."""
        if len(positions) == 0:
            return self.random
        at = np.asarray(positions, dtype=np.int64)
        if self._last is not None:
            at = np.concatenate(([self._last], at))
        self._last = int(at[-1])
        steps = np.diff(at)
        count, sequential = len(steps), int(np.count_nonzero((steps > 0) & (steps <= _NEAR)))
        self._batches.append((count, sequential))
        self._steps += count
        self._sequential += sequential
        while self._steps - self._batches[0][0] >= _WINDOW:  # keep about _WINDOW steps
            old_count, old_sequential = self._batches.popleft()
            self._steps -= old_count
            self._sequential -= old_sequential
        if self._steps < 8:  # too few steps to tell: stay as the kernel has it
            return self.random
        return self._sequential < _SEQUENTIAL_SHARE * self._steps

    def before_read(
        self, file: Any, positions: Sequence[int], spans: Iterable[tuple[int, int]]
    ) -> None:
        """Advise ``file`` (an ``mmap.mmap``) before records at ``positions`` are read.

        ``spans`` are the records' (offset in ``file``, length), iterated only after the map's
        access advice is set (finding a span may touch the map), and only when WILLNEED is
        issued; ``positions`` their indices in the pack (which tell whether the order is
        random). Errors from ``madvise`` (a closed map, an old kernel) are ignored: advice is
        only a hint.
        """
        if not _HAS_MADVISE:
            return
        if self.bigger_than_memory is None:
            memory = memory_for_cache()
            self.bigger_than_memory = memory is None or len(file) > _FITS_SHARE * memory
        if not self.bigger_than_memory:
            return  # the kernel's read-ahead serves a pack the page cache can keep
        random = self.observe(positions)
        try:
            if self.random_access and random != self.random:
                _madvise(file, mmap.MADV_RANDOM if random else mmap.MADV_NORMAL)
                self.random = random
            if self.willneed and self._willneed_now():
                before = _thread_read_bytes()
                for start, length in page_ranges(spans, len(file)):
                    _madvise(file, mmap.MADV_WILLNEED, start, length)
                self._count_cached(before, _thread_read_bytes())
        except (OSError, ValueError):
            pass

    def willneed_pages(self, file: Any, pages: Iterable[int], size: int) -> None:
        """Advise ``MADV_WILLNEED`` on whole pages of ``file`` (``size`` bytes each, at
        ``page * size``), when this map gets WILLNEED at all: an index's pages (LMDB's leaves),
        asked for together before they are walked one at a time."""
        if not (_HAS_MADVISE and self.bigger_than_memory and self.willneed):
            return
        if self.willneed_paused:
            return
        spans = [(page * size, size) for page in pages]
        try:
            for start, length in page_ranges(spans, len(file)):
                _madvise(file, mmap.MADV_WILLNEED, start, length)
        except (OSError, ValueError):
            pass

    def _willneed_now(self) -> bool:
        faults = _thread_major_faults()
        missed = faults is None or self._faults is None or faults > self._faults
        self._faults = faults
        if self.willneed_paused and missed:
            self.willneed_paused = False
        return not self.willneed_paused

    def _count_cached(self, before: int | None, after: int | None) -> None:
        if before is None or after is None or after > before:
            self._cached_batches = 0
            return
        self._cached_batches += 1
        if self._cached_batches >= _CACHED_BATCHES:
            self.willneed_paused = True
            self._cached_batches = 0
            self._faults = _thread_major_faults()


def _madvise(file: Any, option: int, *where: int) -> None:
    """``file.madvise(option, *where)``: one place to watch (the tests spy on it)."""
    file.madvise(option, *where)


def page_ranges(spans: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The page-aligned (start, length) ranges covering ``spans`` inside a map of ``size``
    bytes: sorted, overlapping and touching ranges merged, then cut into pieces of at most
    ``_CHUNK`` bytes (see NOTE [ Read advice for packs bigger than memory ]). Spans outside
    the map are left out (the read reports them)."""
    pages = []
    for offset, length in spans:
        if length <= 0 or offset < 0 or offset + length > size:
            continue
        end = offset + length
        pages.append((offset - offset % _PAGE, min(size, end + -end % _PAGE)))
    pages.sort()
    merged: list[list[int]] = []
    for start, end in pages:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    ranges = []
    for start, end in merged:
        while start < end:
            length = min(_CHUNK, end - start)
            ranges.append((start, length))
            start += length
    return ranges


def fits_in_memory(nbytes: int, memory: int | None = None) -> bool | None:
    """Whether ``nbytes`` of data stay in the page cache: at most ``_FITS_SHARE`` of
    ``memory`` (default: :func:`memory_for_cache`), the share under which packs get no read
    advice. None where the memory is unknown. The diagnosis uses the same rule."""
    memory = memory_for_cache() if memory is None else memory
    return None if memory is None else nbytes <= _FITS_SHARE * memory
