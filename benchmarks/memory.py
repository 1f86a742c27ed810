"""Worker memory over epochs: packed datasets vs the image folder.

A forked DataLoader worker shares its parent's memory until it writes to it. A dataset that
keeps its index as Python objects (``ImageFolder``'s list of ``(path, label)`` tuples) makes
the worker write to those pages just by reading them (reference counts, the garbage
collector), so every worker slowly gets its own copy: memory grows over the epoch, times the
number of workers. fastloader's packed datasets keep their index in NumPy arrays, so their
workers should stay flat.

Each dataset (the image folder, ``LMDBDataset``, ``HDF5Dataset``; the same photos, the
``encoded`` store, the same transform) is read by ``fastloader.DataLoader`` with 2 workers,
and each worker's memory is sampled after the first batch, in the middle and at the end.
The metric is the worker's *private dirty* memory (``Private_Dirty`` of
``/proc/<pid>/smaps_rollup``: pages it has written, copy-on-write copies included), which,
unlike USS, leaves out the clean page cache of a memory-mapped file (LMDB's reads). RSS is
reported too. Without ``/proc`` (not Linux) psutil's USS is used if psutil is installed.

Run alone: ``python -m benchmarks --only memory``.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from benchmarks._photos import ImageFolderDataset, ResizeCenterCrop, image_folder, packed
from benchmarks._stats import significant
from benchmarks.formats import fastloader_loader, pack_dataset

SIZES = {
    #        images, batch, epochs
    "tiny": (32, 8, 1),
    "quick": (384, 32, 2),
    "full": (2048, 64, 3),
}
MIB = 1024 * 1024


def _smaps_rollup(pid: int) -> dict[str, int] | None:
    """The byte counts of ``/proc/<pid>/smaps_rollup``, or None where there is none."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if len(fields) == 2 and fields[1] == "kB":
            values[name] = int(fields[0]) * 1024
    return values


def memory_probe() -> tuple[str, Callable[[int], tuple[int, int]]] | None:
    """``(metric name, pid -> (metric bytes, rss bytes))`` for this system, or None."""
    own = _smaps_rollup(os.getpid())
    if own is not None and "Private_Dirty" in own and "Rss" in own:

        def from_proc(pid: int) -> tuple[int, int]:
            values = _smaps_rollup(pid) or {}
            return values.get("Private_Dirty", 0), values.get("Rss", 0)

        return "private_dirty", from_proc
    try:
        import psutil
    except ImportError:
        return None

    def from_psutil(pid: int) -> tuple[int, int]:
        info = psutil.Process(pid).memory_full_info()
        return info.uss, info.rss

    return "uss", from_psutil


def _sample(loader: Any, probe: Callable[[int], tuple[int, int]]) -> tuple[float, float]:
    """Mean private and RSS MiB over the loader's worker processes."""
    readings = [probe(pid) for pid in loader.worker_pids]
    if not readings:
        raise RuntimeError("the loader has no running workers to measure")
    return (
        statistics.fmean(private for private, _ in readings) / MIB,
        statistics.fmean(rss for _, rss in readings) / MIB,
    )


def worker_memory(
    dataset: Dataset, batch: int, epochs: int, probe: Callable[[int], tuple[int, int]]
) -> dict[str, float]:
    """Worker memory (MiB, mean per worker) after the first batch, mid-way and at the end."""
    loader = fastloader_loader(dataset, batch)
    batches = len(loader) * epochs
    middle = batches // 2
    samples: dict[str, tuple[float, float]] = {}
    seen = 0
    try:
        for _ in range(epochs):
            for _ in loader:
                seen += 1
                if seen == 1:
                    samples["start"] = _sample(loader, probe)
                if seen == max(middle, 1):
                    samples["middle"] = _sample(loader, probe)
        samples["end"] = _sample(loader, probe)
    finally:
        loader.close()
    result = {f"{point}_mib": round(private, 2) for point, (private, _) in samples.items()}
    result["growth_mib"] = round(samples["end"][0] - samples["start"][0], 2)
    result["end_over_start"] = significant(samples["end"][0] / samples["start"][0])
    result["rss_start_mib"] = round(samples["start"][1], 1)
    result["rss_end_mib"] = round(samples["end"][1], 1)
    result["rss_growth_mib"] = round(samples["end"][1] - samples["start"][1], 2)
    return result


def run(size: str, workdir: Path) -> dict:
    """Run the memory comparison at ``size`` ("tiny", "quick", "full") with data in workdir."""
    images, batch, epochs = SIZES[size]
    found = memory_probe()
    if found is None:
        return {
            "comparison": "memory",
            "skipped": "no /proc/<pid>/smaps_rollup and no psutil to read worker memory",
            "rows": [],
            "ratios": {},
        }
    metric, probe = found
    folder = image_folder(workdir, images)
    datasets = {"image folder": ImageFolderDataset(folder, ResizeCenterCrop())}
    for format in ("lmdb", "hdf5"):
        path = packed(folder, workdir, format, "encoded", None)
        datasets[format] = pack_dataset(path, format, "pil")
    rows = [
        {"dataset": name, **worker_memory(dataset, batch, epochs, probe)}
        for name, dataset in datasets.items()
    ]
    return {
        "comparison": "memory",
        "config": {
            "images": images,
            "batch_size": batch,
            "epochs": epochs,
            "num_workers": 2,
            "metric": metric,
        },
        "rows": rows,
        "ratios": {
            f"{row['dataset'].replace(' ', '_')}_end_over_start": row["end_over_start"]
            for row in rows
        },
        "notes": [
            f"{metric} MiB per worker (mean of 2), sampled after the first batch, mid-way and "
            f"at the end of {epochs} epoch(s); growth = end - start (signed)",
            f"{images} images: Python-object growth scales with the dataset's length, so small "
            "runs show little of it",
        ],
    }
