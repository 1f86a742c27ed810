"""Read throughput of the packed formats vs the image folder they were packed from.

Every row reads the same photos (the suite's image folder, see ``_photos.py``) with 2 workers,
batch 64, shuffled, through the same evaluation transform (shorter side to 224, centre crop,
uint8 CHW tensor), so only the storage and decoding differ:

- ``image folder``: one JPEG file per sample, decoded by PIL (a minimal ``ImageFolder``), read
  by torch's DataLoader (the baseline) and by fastloader's;
- ``LMDBDataset`` and ``HDF5Dataset`` read by ``fastloader.DataLoader`` in each store mode:
  ``encoded`` (the original files' bytes), ``jpeg`` (re-encoded, longer side <= 256) and
  ``raw`` (decoded uint8 pixels, longer side <= 256), the last both decoded to a PIL image and
  to a tensor (``decode="tensor"``, resized by torch, no PIL at all).

Reported: samples/s (median over timed epochs; each pass over the rows makes a fresh loader,
runs an untimed warm-up epoch, then back-to-back timed epochs with the workers kept: the steady
rate of the storage and decoding, not worker start-up, which ``loader`` measures), the ratio
to the image folder read by torch, and the bytes on disk of each. The page cache is warm: this
is the decode and read-path cost, not the disk's.

Run alone: ``python -m benchmarks --only formats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks._photos import (
    ImageFolderDataset,
    ResizeCenterCrop,
    folder_bytes,
    image_folder,
    packed,
)
from benchmarks._stats import significant

SIZES = {
    #        images, batch, passes, timed epochs per pass
    "tiny": (32, 8, 1, 1),
    "quick": (384, 64, 1, 3),
    "full": (2048, 64, 2, 3),
}
WORKERS = 2
SHORT_SIDE = 224  # pack at the training size: reading needs only the centre crop
FORMATS = ("lmdb", "hdf5")
STORES = ("encoded", "jpeg", "raw")
MIB = 1024 * 1024


def epoch_rates(loader: Iterable, epochs: int, warmup: int = 1) -> list[float]:
    """Samples/s of each of ``epochs`` back-to-back epochs of ``loader``, after ``warmup``."""
    rates = []
    for epoch in range(warmup + epochs):
        started = time.perf_counter()
        samples = 0
        for batch in loader:
            samples += len(batch[1]) if isinstance(batch, (list, tuple)) else _length(batch)
        if epoch >= warmup:
            rates.append(samples / (time.perf_counter() - started))
    return rates


def _length(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch)


def close_loader(loader: Any) -> None:
    """Stop a loader's worker processes (fastloader's ``close``, or torch's iterator's)."""
    if hasattr(loader, "close"):
        loader.close()
        return
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def fastloader_loader(dataset: Dataset, batch: int) -> Any:
    """The fastloader.DataLoader every packed-format row reads with."""
    from fastloader import DataLoader

    return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=WORKERS, seed=0)


def torch_loader(dataset: Dataset, batch: int) -> TorchDataLoader:
    """torch's DataLoader as the baseline reads (persistent workers: the steady read rate)."""
    return TorchDataLoader(
        dataset, batch_size=batch, shuffle=True, num_workers=WORKERS, persistent_workers=True
    )


def pack_dataset(path: Path, format: str, decode: str, checksums: bool = True) -> Dataset:
    """``LMDBDataset``/``HDF5Dataset`` over ``path`` with the benchmark's transform."""
    from fastloader import HDF5Dataset, LMDBDataset

    reader = {"lmdb": LMDBDataset, "hdf5": HDF5Dataset}[format]
    return reader(path, transform=ResizeCenterCrop(), decode=decode, verify_checksums=checksums)


class _Case(NamedTuple):
    labels: dict[str, str]  # reader, store, decode, loader
    make_loader: Callable[[], Any]
    size_bytes: int  # on disk


def _cases(folder: Path, workdir: Path, batch: int) -> list[_Case]:
    """Every row to measure, the baseline (image folder read by torch) first."""
    folder_size = folder_bytes(folder)

    def folder_case(loader: str, make: Callable[[Dataset, int], Any]) -> _Case:
        labels = {
            "reader": "image folder",
            "store": "jpeg files",
            "decode": "pil",
            "loader": loader,
        }
        return _Case(
            labels, lambda: make(ImageFolderDataset(folder, ResizeCenterCrop()), batch), folder_size
        )

    def pack_case(path: Path, format: str, store: str, decode: str, checksums: bool) -> _Case:
        labels = {"reader": format, "store": store, "decode": decode, "loader": "fastloader"}
        if not checksums:
            labels["decode"] += ", no checksum"
        return _Case(
            labels,
            lambda: fastloader_loader(pack_dataset(path, format, decode, checksums), batch),
            path.stat().st_size,
        )

    cases = [folder_case("torch", torch_loader), folder_case("fastloader", fastloader_loader)]
    for format in FORMATS:
        for store in STORES:
            path = packed(folder, workdir, format, store, SHORT_SIDE)
            for decode in ("pil", "tensor") if store == "raw" else ("pil",):
                cases.append(pack_case(path, format, store, decode, True))
            if store == "raw":  # what verifying each record's checksum costs: on vs off
                cases.append(pack_case(path, format, store, "tensor", False))
    return cases


def checksum_cost(path: Path, format: str, rounds: int = 7) -> dict:
    """Raw-pack read throughput with checksums verified vs not, in this process, interleaved.

    Two read paths over the records of a raw pack, batches of 64: ``pipeline`` is what the
    table's raw rows do (uint8 CHW tensor, centre crop to 224), ``bare`` only copies each
    record's pixels out (uint8 HWC array, no transform), where a checksum costs most relative
    to the read. Rounds alternate on/off; reported: median records/s and the median of the
    per-round on/off ratios. Torch runs one thread, as in a DataLoader worker.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        return _checksum_cost(path, format, rounds)
    finally:
        torch.set_num_threads(threads)


def _checksum_cost(path: Path, format: str, rounds: int) -> dict:
    from fastloader import HDF5Dataset, LMDBDataset

    reader = {"lmdb": LMDBDataset, "hdf5": HDF5Dataset}[format]
    result: dict = {"format": format}
    for path_name, decode, transform, repeats in (
        ("pipeline", "tensor", ResizeCenterCrop(), 1),
        ("bare", "numpy", None, 4),
    ):
        datasets = {
            on: reader(path, decode=decode, transform=transform, verify_checksums=on)
            for on in (True, False)
        }
        count = len(datasets[True])
        batches = [list(range(i, min(i + 64, count))) for i in range(0, count, 64)] * repeats
        rates: dict[bool, list[float]] = {True: [], False: []}
        for number in range(rounds + 1):
            for on in (True, False) if number % 2 else (False, True):
                started = time.perf_counter()
                for batch in batches:
                    datasets[on].__getitems__(batch)
                if number:  # round 0 warms the page cache and both datasets
                    rates[on].append(count * repeats / (time.perf_counter() - started))
        ratios = [on / off for on, off in zip(rates[True], rates[False], strict=True)]
        result[path_name] = {
            "records_per_s_on": round(statistics.median(rates[True])),
            "records_per_s_off": round(statistics.median(rates[False])),
            "on_vs_off": round(statistics.median(ratios), 4),
        }
    return result


def run(size: str, workdir: Path) -> dict:
    """Run the format comparison at ``size`` ("tiny", "quick", "full") with data in workdir."""
    images, batch, passes, epochs = SIZES[size]
    folder = image_folder(workdir, images)
    cases = _cases(folder, Path(workdir), batch)
    rates: list[list[float]] = [[] for _ in cases]
    for number in range(passes):
        order = range(len(cases)) if number % 2 == 0 else reversed(range(len(cases)))
        for index in order:  # alternate the order so that a drift in load hits rows evenly
            loader = cases[index].make_loader()
            try:
                rates[index] += epoch_rates(loader, epochs)
            finally:
                close_loader(loader)
    rows = [
        {
            **case.labels,
            "samples_per_s": round(statistics.median(rate), 1),
            "size_mib": round(case.size_bytes / MIB, 2),
        }
        for case, rate in zip(cases, rates, strict=True)
    ]
    baseline = rows[0]["samples_per_s"]
    ratios = {}
    for row in rows:
        row["vs_image_folder"] = significant(row["samples_per_s"] / baseline)
        if row is not rows[0]:
            ratios[_key(row) + "_vs_image_folder"] = row["vs_image_folder"]
    best_raw = max(row["vs_image_folder"] for row in rows if row["store"] == "raw")
    for format in FORMATS:
        on, off = (
            next(r for r in rows if r["reader"] == format and r["decode"] == decode)
            for decode in ("tensor", "tensor, no checksum")
        )
        ratios[f"{format}_raw_tensor_checksums_on_vs_off"] = round(
            on["samples_per_s"] / off["samples_per_s"], 3
        )
    for format in FORMATS:
        cost = checksum_cost(packed(folder, workdir, format, "raw", SHORT_SIDE), format)
        for name in ("pipeline", "bare"):
            ratios[f"{format}_raw_{name}_read_checksums_on_vs_off"] = cost[name]["on_vs_off"]
    return {
        "comparison": "formats",
        "config": {
            "images": images,
            "batch_size": batch,
            "num_workers": WORKERS,
            "passes": passes,
            "timed_epochs_per_pass": epochs,
            "output": [3, 224, 224],
            "short_side": SHORT_SIDE,
        },
        "rows": rows,
        "ratios": ratios,
        "notes": [
            "samples/s: median over epochs; each pass: a fresh loader, a warm-up epoch, then "
            "back-to-back timed epochs (persistent workers); warm page cache",
            "raw/jpeg packs were made with short_side=224 (the training size), so reading them "
            "needs only the centre crop; the image folder is resized from the original files",
            f"goal: raw packs >= 5x the image folder; best raw here: {best_raw:.2f}x",
            "checksums: every pack row verifies each record's xxh3 checksum (the default); "
            "the 'no checksum' rows read the same raw packs with verify_checksums=False",
        ],
    }


def _key(row: dict) -> str:
    if row["reader"] == "image folder":
        return f"image_folder_{row['loader']}"
    suffix = {"tensor": "_tensor", "tensor, no checksum": "_tensor_no_checksum"}.get(
        row["decode"], ""
    )
    return f"{row['reader']}_{row['store']}{suffix}"
