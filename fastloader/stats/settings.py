"""What the diagnosis knows of the loader besides its timings: the settings that decide which
advice can still change the numbers (NOTE [ Advice that changes the numbers ] in
stats/diagnosis.py), read when an epoch starts.

Runs in the main process; reads the loader's attributes by name (stats sits below loader/),
the dataset's files' sizes and the memory the page cache may use.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from fastloader.datasets.collate import DEFAULT_COLLATES
from fastloader.formats.advice import memory_for_cache


@dataclasses.dataclass(frozen=True)
class LoaderSettings:
    """The settings of the loader an epoch ran with.

    Attributes:
        persistent_workers: workers are kept across epochs.
        device_type: "cuda", "cpu", ... of ``device=``; None without one.
        pinned: batches are pinned before the device copy (``pin_memory`` or ``device="cuda"``).
        device_transform: a ``device_transform`` runs on each batch.
        cpus: CPUs this process may use.
        data_bytes: the size of the dataset's files when it reads from known files (a pack,
            a user's HDF5 or LMDB file), else None.
        memory_bytes: the memory the page cache may use (``MemAvailable``, cgroup limits);
            None where unknown.
        default_collate: ``collate_fn`` is torch's or fastloader's default one (whose cost
            next to loading is small: the workers' busy time then stands for the batch).
    """

    persistent_workers: bool = False
    device_type: str | None = None
    pinned: bool = False
    device_transform: bool = False
    cpus: int | None = None
    data_bytes: int | None = None
    memory_bytes: int | None = None
    default_collate: bool = False


def loader_settings(loader: Any) -> LoaderSettings:
    """The :class:`LoaderSettings` of ``loader`` (a fastloader or torch DataLoader) now."""
    device = getattr(loader, "device", None)
    device_type = None if device is None else str(device).split(":", 1)[0]
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return LoaderSettings(
        persistent_workers=bool(getattr(loader, "persistent_workers", False)),
        device_type=device_type,
        pinned=bool(getattr(loader, "pin_memory", False)) or device_type == "cuda",
        device_transform=getattr(loader, "device_transform", None) is not None,
        cpus=len(usable) if usable is not None else os.cpu_count(),
        data_bytes=dataset_bytes(getattr(loader, "dataset", None)),
        memory_bytes=_recent_memory_for_cache(),
        default_collate=getattr(loader, "collate_fn", None) in DEFAULT_COLLATES,
    )


#: (when it was read, the bytes): the memory the page cache may use, read at most once a second
_memory_read: tuple[float, int | None] = (float("-inf"), None)
MEMORY_READ_EVERY_S = 1.0


def _recent_memory_for_cache() -> int | None:
    # memory_for_cache reads /proc and every level of the memory cgroups: 130 us, a third of
    # an epoch's start for cheap data in the main process (issue 30); epochs shorter than a
    # second share one reading, which advice about a pack bigger than memory does not miss
    global _memory_read
    read_at, memory = _memory_read
    now = time.monotonic()
    if now - read_at >= MEMORY_READ_EVERY_S:
        memory = memory_for_cache()
        _memory_read = (now, memory)
    return memory


def dataset_bytes(dataset: Any, depth: int = 0) -> int | None:
    """The size of the files ``dataset`` reads, through torch's wrappers (``Subset``,
    ``ConcatDataset``) and ours; None for anything else (a folder of images, generated data)."""
    if dataset is None or depth > 8:
        return None
    path = getattr(dataset, "path", None)
    if isinstance(path, (str, os.PathLike)):
        return _size(path)
    parts = getattr(dataset, "datasets", None)  # ConcatDataset
    if isinstance(parts, (list, tuple)) and parts:
        sizes = [dataset_bytes(part, depth + 1) for part in parts]
        return None if None in sizes else sum(sizes)
    return dataset_bytes(getattr(dataset, "dataset", None), depth + 1)  # Subset, wrappers


def _size(path: str | os.PathLike) -> int | None:
    """A file's size, or the files directly in a folder (an LMDB environment)."""
    try:
        if os.path.isdir(path):
            with os.scandir(path) as entries:
                files = [e.stat() for e in entries if e.is_file(follow_symlinks=False)]
        else:
            files = [os.stat(path)]
    except OSError:
        return None
    return sum(_stored(stat) for stat in files)


def _stored(stat: os.stat_result) -> int:
    """Bytes a file holds on disk: a sparse file (an LMDB map grown ahead) counts its blocks."""
    blocks = getattr(stat, "st_blocks", None)
    return stat.st_size if blocks is None else min(stat.st_size, blocks * 512)
