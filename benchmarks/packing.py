"""Packing throughput of ``fastloader.pack``, with litdata as a peer that does the same job.

``fastloader.pack`` converts the suite's image folder into each format (LMDB, HDF5) and store
mode (``encoded``: the files' bytes, checked to decode; ``jpeg`` and ``raw``: decoded, shrunk
to a longer side of 256, re-encoded or kept as pixels) with 2 worker processes. The peer is
litdata's ``optimize()`` (2 workers, 64 MB chunks) over the same files, writing the files'
bytes (like ``encoded``, but unchecked) and decoded, shrunk pixels as NumPy arrays (like
``raw``). Reported: images/s of each, bytes written, and fastloader's ratio to litdata.

Then both are read back the same way: litdata's ``StreamingDataset`` + ``StreamingDataLoader``
against ``fastloader.DataLoader`` over ``LMDBDataset``, 2 workers, batch 64, shuffled, the
``formats`` transform (224x224 uint8 CHW), samples/s after a warm-up epoch.

litdata is optional (``pip install --no-deps litdata``): when it cannot be imported or fails,
its rows are left out and ``peer_skipped`` says why; fastloader's rows are still reported.

Run alone: ``python -m benchmarks --only packing``.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks._photos import ResizeCenterCrop, image_folder, scan_image_folder
from benchmarks._stats import significant
from benchmarks.formats import close_loader, epoch_rates, fastloader_loader, pack_dataset
from fastloader import pack

SIZES = {
    #        images, pack repeats, batch, timed read epochs
    "tiny": (32, 1, 8, 1),
    "quick": (384, 1, 64, 2),
    "full": (2048, 2, 64, 3),
}
WORKERS = 2
MAX_SIDE = 256
FORMATS = {"lmdb": ".lmdb", "hdf5": ".h5"}
STORES = ("encoded", "jpeg", "raw")
PEER_STORES = ("encoded", "raw")  # the store modes litdata has a counterpart for
MIB = 1024 * 1024


# -- litdata's side: module-level so its worker processes can reach them ----------------------


def litdata_encoded(item: tuple[str, int]) -> dict[str, Any]:
    """litdata ``optimize`` fn: the file's bytes and label (like ``store="encoded"``)."""
    path, label = item
    with open(path, "rb") as file:
        return {"image": file.read(), "label": label}


def litdata_raw(item: tuple[str, int]) -> dict[str, Any]:
    """litdata ``optimize`` fn: decoded RGB pixels, longer side <= 256 (like ``store="raw"``)."""
    path, label = item
    with open(path, "rb") as file:
        image = Image.open(file).convert("RGB")
    scale = MAX_SIDE / max(image.size)
    if scale < 1:
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return {"image": np.asarray(image), "label": label}


class LitdataTransform:
    """Turns a litdata item into ``(uint8 CHW 224x224 tensor, label)`` like the formats rows."""

    def __init__(self) -> None:
        self.resize = ResizeCenterCrop()

    def __call__(self, item: dict[str, Any]) -> tuple[Any, int]:
        image = item["image"]
        if not isinstance(image, np.ndarray):
            image = Image.open(io.BytesIO(image)).convert("RGB")
        return self.resize(image), item["label"]


@contextlib.contextmanager
def _quiet(log: Path) -> Iterator[None]:
    """Send this process's (and its children's) stdout and stderr to ``log``.

    Also restores the multiprocessing start method, which litdata's ``optimize`` sets globally.
    """
    start_method = multiprocessing.get_start_method(allow_none=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            multiprocessing.set_start_method(start_method, force=True)


def _tree_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _litdata_pack(items: list[tuple[str, int]], out: Path, store: str, log: Path) -> float:
    """Seconds litdata's ``optimize`` takes to write ``items`` into ``out``."""
    from litdata import optimize

    shutil.rmtree(out, ignore_errors=True)
    fn = {"encoded": litdata_encoded, "raw": litdata_raw}[store]
    started = time.perf_counter()
    with _quiet(log):
        optimize(
            fn=fn,
            inputs=items,
            output_dir=str(out),
            num_workers=WORKERS,
            chunk_bytes="64MB",
            mode="overwrite",
            start_method="fork",
            verbose=False,
        )
    return time.perf_counter() - started


def _litdata_loader(out: Path, batch: int) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(str(out), transform=LitdataTransform(), shuffle=True)
    return StreamingDataLoader(
        dataset, batch_size=batch, num_workers=WORKERS, persistent_workers=True
    )


def _fastloader_packs(folder: Path, workdir: Path, repeats: int) -> tuple[list[dict], dict]:
    """Pack ``folder`` in every format and store mode; rows and the LMDB packs' paths.

    Every pack is made with ``check="full"`` (the default: every image decoded, JPEGs strictly);
    LMDB also with ``check="quick"`` (header and end marker only, what packing did before
    issue 10), interleaved with it, so the rows show what the full check costs.
    """
    rows, lmdb_paths = [], {}
    for format, suffix in FORMATS.items():
        for store in STORES:
            path = workdir / f"{store}{suffix}"
            checks = ("full", "quick") if format == "lmdb" else ("full",)
            seconds: dict[str, list[float]] = {check: [] for check in checks}
            sizes, count = {}, 0
            for number in range(repeats):
                for check in checks if number % 2 == 0 else reversed(checks):
                    started = time.perf_counter()
                    summary = pack(
                        folder,
                        path,
                        store=store,
                        max_side=None if store == "encoded" else MAX_SIDE,
                        workers=None,  # the default: 2 here, none for "encoded" (files checked)
                        overwrite=True,
                        progress=False,
                        check=check,
                    )
                    seconds[check].append(time.perf_counter() - started)
                    count, sizes[check] = summary.count, summary.size_bytes
            for check in checks:
                tool = "fastloader" if check == "full" else "fastloader (check quick)"
                rows.append(_pack_row(tool, format, store, count, seconds[check], sizes[check]))
            if format == "lmdb":
                lmdb_paths[store] = path
    return rows, lmdb_paths


def _pack_row(
    tool: str, format: str, store: str, count: int, seconds: list[float], size: int
) -> dict:
    median = statistics.median(seconds)
    return {
        "tool": tool,
        "format": format,
        "store": store,
        "images_per_s": round(count / median, 1),
        "seconds": round(median, 3),
        "size_mib": round(size / MIB, 2),
    }


def _litdata_rows(
    folder: Path, workdir: Path, lmdb_paths: dict, sizes: tuple[int, int, int, int]
) -> tuple[list[dict], list[dict]]:
    """litdata's pack rows and the read rows of litdata vs fastloader (raises if litdata fails)."""
    images, repeats, batch, epochs = sizes
    samples, _ = scan_image_folder(folder)
    items = [(str(path), label) for path, label in samples]
    log = workdir / "litdata.log"
    pack_rows, read_rows = [], []
    for store in PEER_STORES:
        out = workdir / f"litdata-{store}"
        seconds = [_litdata_pack(items, out, store, log) for _ in range(repeats)]
        pack_rows.append(
            _pack_row("litdata", "chunks", store, len(items), seconds, _tree_bytes(out))
        )
        decode = "tensor" if store == "raw" else "pil"
        loaders = {
            "litdata": lambda out=out: _litdata_loader(out, batch),
            "fastloader": lambda store=store, decode=decode: fastloader_loader(
                pack_dataset(lmdb_paths[store], "lmdb", decode), batch
            ),
        }
        for tool, make in loaders.items():
            loader = make()
            try:
                with _quiet(log):
                    rates = epoch_rates(loader, epochs)
            finally:
                close_loader(loader)
            read_rows.append(
                {
                    "tool": tool,
                    "format": "lmdb" if tool == "fastloader" else "chunks",
                    "store": store,
                    "decode": decode,
                    "samples_per_s": round(statistics.median(rates), 1),
                }
            )
    return pack_rows, read_rows


def run(size: str, workdir: Path) -> dict:
    """Run the packing comparison at ``size`` ("tiny", "quick", "full") with data in workdir."""
    images, repeats, batch, epochs = SIZES[size]
    folder = image_folder(workdir, images)
    out = Path(workdir) / "packing"
    out.mkdir(parents=True, exist_ok=True)
    rows, lmdb_paths = _fastloader_packs(folder, out, repeats)
    peer_skipped = None
    read_rows: list[dict] = []
    try:
        peer_rows, read_rows = _litdata_rows(folder, out, lmdb_paths, SIZES[size])
    except Exception as error:  # noqa: BLE001 - an optional peer must never stop the suite
        peer_skipped = f"litdata: {type(error).__name__}: {error}".strip()
        peer_rows, read_rows = [], []
    rows += peer_rows
    ratios = _ratios(rows, read_rows)
    return {
        "comparison": "packing",
        "config": {
            "images": images,
            "repeats": repeats,
            "workers": WORKERS,
            "max_side": MAX_SIDE,
            "read_batch_size": batch,
            "read_epochs": epochs,
        },
        "rows": rows,
        "read_rows": read_rows,
        "ratios": ratios,
        "peer_skipped": peer_skipped,
        "notes": [
            "images/s: pack of the whole folder (scan, check or decode/encode, write, sync) with "
            "pack()'s default workers: 2, except none for encoded with check quick (files are "
            "only checked for their header and end marker)",
            "check full (default): every stored image is decoded (JPEGs by libjpeg-turbo, strict, "
            "at 1/8 scale); check quick: header and end marker only (packing before issue 10)",
            "litdata optimize: start_method='fork' (its default, spawn, adds seconds of start-up)"
            "; 'encoded' stores the bytes unchecked, fastloader checks each file",
            "read: samples/s, median over epochs after a warm-up epoch, persistent workers",
        ],
    }


def _ratios(rows: list[dict], read_rows: list[dict]) -> dict[str, float]:
    peer = {row["store"]: row for row in rows if row["tool"] == "litdata"}
    ratios = {}
    quick = {row["store"]: row for row in rows if row["tool"] == "fastloader (check quick)"}
    for row in rows:
        if row["tool"] == "fastloader" and row["format"] == "lmdb" and row["store"] in quick:
            ratio = row["images_per_s"] / quick[row["store"]]["images_per_s"]
            ratios[f"pack_lmdb_{row['store']}_check_full_vs_quick"] = significant(ratio)
    for row in rows:
        if row["tool"] == "fastloader" and row["store"] in peer:
            ratio = row["images_per_s"] / peer[row["store"]]["images_per_s"]
            row["vs_litdata"] = significant(ratio)
            ratios[f"pack_{row['format']}_{row['store']}_vs_litdata"] = row["vs_litdata"]
    peer_reads = {row["store"]: row for row in read_rows if row["tool"] == "litdata"}
    for row in read_rows:
        if row["tool"] == "fastloader":
            ratio = row["samples_per_s"] / peer_reads[row["store"]]["samples_per_s"]
            row["vs_litdata"] = significant(ratio)
            ratios[f"read_lmdb_{row['store']}_vs_litdata"] = row["vs_litdata"]
    return ratios
