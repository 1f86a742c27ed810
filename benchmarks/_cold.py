"""Cold storage for benchmarks: evicting files from the page cache, the disk's read-ahead, and
a memory cgroup smaller than the data (``oom.py``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

MIB = 1024 * 1024
_CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def data_files(path: Path) -> list[Path]:
    """The files under ``path`` (itself if a file)."""
    return sorted(path.iterdir()) if path.is_dir() else [path]


def evict(paths: Sequence[Path]) -> None:
    """Drop the files' clean pages from the page cache (``posix_fadvise(DONTNEED)``)."""
    for path in paths:
        for file in data_files(path):
            with contextlib.suppress(OSError):
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def read_ahead_path(path: Path) -> Path | None:
    """The ``read_ahead_kb`` file of the block device holding ``path``, if there is one."""
    dev = os.stat(path).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (block / "queue" / "read_ahead_kb", block / ".." / "queue" / "read_ahead_kb"):
        if candidate.exists():
            return candidate
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int | None) -> Iterator[str | None]:
    """Run the body (and the workers it forks) in a cgroup-v1 memory cgroup of ``limit_bytes``;
    yields a description, or None where it cannot (no root, no v1 memory controller)."""
    parent = _CGROUP_ROOT / "cgroup.procs"
    if not limit_bytes or not (parent.exists() and os.access(parent, os.W_OK)):
        yield None
        return
    group = _CGROUP_ROOT / f"fastloader-oom-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        yield None
        return
    try:
        yield f"memory cgroup v1, limit {limit_bytes / MIB:.0f} MiB"
    finally:
        with contextlib.suppress(OSError):
            parent.write_text(str(os.getpid()))
        for _ in range(50):  # the group empties once the workers are reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
