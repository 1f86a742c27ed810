"""Bigger than memory: packs vs files read from cold storage, with and without read advice.

The other comparisons read from a warm page cache. Here every reader starts cold: before each
measurement the files it reads are evicted from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed), and, where this process may (root and
a cgroup-v1 memory controller at ``/sys/fs/cgroup/memory``), the readers run in a memory cgroup
smaller than the data. Rows, all with 2 workers, batch 64, a centre crop to 224 as a uint8 CHW
tensor, over the same ``count`` random samples of the data (``random``) or its first ``count``
samples (``sequential``):

- ``torch, .npy files``: torch's DataLoader over one ``.npy`` file of pixels per sample (the
  raw pixels, 256 x 341 x 3, as the raw pack stores them);
- ``LMDB raw pack``: ``fastloader.DataLoader`` over an LMDB pack of the same pixels, random and
  sequential, with the pack's read advice (NOTE [ Read advice for packs bigger than memory ] in
  fastloader/formats/advice.py) and without it (``read_advice=False``: as before issue 23);
- ``LMDB raw pack, block shuffle``: the first samples of ``BlockShuffleSampler``'s order
  (blocks of 64 records, shuffled within windows of 8 blocks), for slow storage;
- ``torch, JPEG files`` and ``LMDB encoded pack``: the same for JPEG files decoded by PIL
  (torch) and a pack of the same JPEG bytes (fastloader's fused decoding);
- with ``--hdf5``, the raw pack in HDF5 too.

Read advice only applies to a pack bigger than half the memory its reader's page cache may use
(cgroup limits included): below that the kernel's read-ahead is kept on purpose. So without a
memory cgroup (not root, or the ``tiny`` size) the rows with and without advice read alike
unless the data is bigger than half the machine's available memory (``--gb``).

Reported: samples/s (from the first batch to the last), bytes read from storage per sample
(``read_bytes`` of ``/proc/<pid>/io`` summed over the workers), against the stored record's
size, and the disk's ``read_ahead_kb``; ratios are medians of per-round ratios (rounds
interleave the rows). Goals (issue 23): raw pack >= 1.5x torch over the files, encoded pack >=
1.0x torch over the same bytes, random >= 0.8x sequential, bytes read per sample <= 1.5x the
record.

Run alone: ``python -m benchmarks.oom [--gb 2] [--rounds 3] [--hdf5] [--read-ahead-kb N]``
(``--gb 12`` for a pack larger than most machines' free memory), or as part of the suite
(``python -m benchmarks --only oom``: sizes tiny/quick/full).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks._cold import evict, memory_cgroup, read_ahead_path
from benchmarks._photos import source_photos
from fastloader.sampling.samplers import BlockShuffleSampler
from fastloader.stats.io_probe import sum_counters

SHAPE = (256, 341, 3)  # ImageNet at short side 256: 262 KB of pixels
ENCODED_TIMES = 4  # JPEGs are ~10x smaller: 4x as many make the encoded pack bigger than memory
CROP = 224
BATCH = 64
WORKERS = 2
SIZES = {
    #        data GB, samples per measurement, rounds
    "tiny": (0.1, 320, 1),
    "quick": (0.5, 768, 2),
    "full": (2.0, 1536, 3),
}
MIB = 1024 * 1024


# --- data -------------------------------------------------------------------------------------
def _bases(count: int = 8) -> list[np.ndarray]:
    photos = list(source_photos()[1].values())
    height, width = SHAPE[:2]
    bases = []
    for i in range(count):
        photo = Image.fromarray(photos[i % len(photos)]).convert("RGB")
        bases.append(np.asarray(photo.resize((width, height), Image.BILINEAR)))
    return bases


def _pixels(bases: list[np.ndarray], index: int) -> np.ndarray:
    pixels = bases[index % len(bases)].copy()
    pixels[0, :8, 0] = np.frombuffer(index.to_bytes(8, "little"), np.uint8)  # each one distinct
    return pixels


def _jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def make_data(workdir: Path, count: int, hdf5: bool) -> dict[str, Path]:
    """Write ``count`` samples as .npy files and a raw LMDB pack (and a raw HDF5 pack), and
    ``ENCODED_TIMES * count`` as JPEG files and an encoded LMDB pack; reused when complete."""
    from fastloader.formats.hdf5 import HDF5Writer
    from fastloader.formats.lmdb import LMDBWriter
    from fastloader.formats.records import RecordKind, encode_record

    root = workdir / f"oom-{count}-{ENCODED_TIMES}"
    paths = {
        "npy": root / "npy",
        "jpeg": root / "jpeg",
        "raw": root / "raw.lmdb",
        "encoded": root / "encoded.lmdb",
    }
    if hdf5:
        paths["raw_hdf5"] = root / "raw.h5"
    done = root / (".complete-hdf5" if hdf5 else ".complete")
    if done.exists():
        return paths
    shutil.rmtree(root, ignore_errors=True)
    paths["npy"].mkdir(parents=True)
    paths["jpeg"].mkdir()
    bases = _bases()
    jpegs = [_jpeg(_pixels(bases, i)) for i in range(64)]  # 64 distinct JPEGs, reused
    classes = [str(i) for i in range(10)]
    writers = [
        ("raw", LMDBWriter(paths["raw"], store="raw", classes=classes)),
        ("encoded", LMDBWriter(paths["encoded"], store="encoded", classes=classes)),
    ]
    if hdf5:
        writers.append(("raw", HDF5Writer(paths["raw_hdf5"], store="raw", classes=classes)))
    for index in range(ENCODED_TIMES * count):
        label = index % 10
        jpeg = jpegs[index % len(jpegs)]
        (paths["jpeg"] / f"{index:07d}.jpg").write_bytes(jpeg)
        records = {"encoded": encode_record(jpeg, label, RecordKind.ENCODED)}
        if index < count:
            pixels = _pixels(bases, index)
            np.save(paths["npy"] / f"{index:07d}.npy", pixels)
            records["raw"] = encode_record(pixels, label, RecordKind.RAW)
        for kind, writer in writers:
            if kind in records:
                writer.append(records[kind], label)
    for _, writer in writers:
        writer.close()
    os.sync()  # dirty pages cannot be evicted: written back first
    done.write_text(str(count))
    return paths


# --- readers ----------------------------------------------------------------------------------
def _centre(pixels: np.ndarray) -> torch.Tensor:
    top = (pixels.shape[0] - CROP) // 2
    left = (pixels.shape[1] - CROP) // 2
    crop = pixels[top : top + CROP, left : left + CROP]
    return torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1)))


class NpyFiles(Dataset):
    """One .npy file of uint8 HWC pixels per sample, as a user's folder of arrays."""

    def __init__(self, root: Path) -> None:
        self.files = [str(path) for path in sorted(root.glob("*.npy"))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return _centre(np.load(self.files[index])), index % 10


class JpegFiles(Dataset):
    """One JPEG file per sample, decoded by PIL (torchvision's ImageFolder loader)."""

    def __init__(self, root: Path) -> None:
        self.files = [str(path) for path in sorted(root.glob("*.jpg"))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as image:
            return _centre(np.asarray(image.convert("RGB"))), index % 10


class Indices:
    """A fixed list of indices as a sampler (no ``set_epoch``: nothing is loaded beyond it)."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = list(indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _pack(path: Path, advice: bool) -> Dataset:
    from fastloader import open_pack
    from fastloader.vision.transforms import CenterCrop

    dataset = open_pack(path, transform=CenterCrop(CROP), decode="tensor")
    dataset.read_advice = advice
    return dataset


def _torch_loader(dataset: Dataset, order: Sequence[int]) -> Any:
    return TorchDataLoader(
        dataset,
        batch_size=BATCH,
        sampler=Indices(order),
        num_workers=WORKERS,
        persistent_workers=True,
    )


def _fast_loader(dataset: Dataset, order: Sequence[int]) -> Any:
    from fastloader import DataLoader

    return DataLoader(dataset, batch_size=BATCH, sampler=Indices(order), num_workers=WORKERS)


class Row:
    """One reader of the table: how to make its loader, the files it reads, its order."""

    def __init__(
        self,
        name: str,
        files: Path,
        make: Callable[[], Dataset],
        loader: Callable[[Dataset, Sequence[int]], Any],
        sequential: bool = False,
        blocks: bool = False,
        encoded: bool = False,
    ) -> None:
        self.name, self.files, self.make, self.loader = name, files, make, loader
        self.sequential = sequential
        self.blocks = blocks  # the order of fastloader's BlockShuffleSampler (64 x 8)
        self.encoded = encoded  # reads the ENCODED_TIMES larger JPEG data
        self.rates: list[float] = []
        self.read_per_sample: list[float] = []


def measure(row: Row, order: Sequence[int]) -> tuple[float, float | None]:
    """(samples/s, bytes read from storage per sample) of one cold pass over ``order``."""
    dataset = row.make()  # opened where a training script opens it: before its workers
    evict([row.files])
    loader = row.loader(dataset, order)
    iterator = iter(loader)
    first = next(iterator)
    started = time.perf_counter()
    samples = 0
    for batch in iterator:
        samples += len(batch[1])
    seconds = time.perf_counter() - started
    pids = [worker.pid for worker in iterator._workers]
    read = sum_counters(pids).read_bytes
    total = samples + len(first[1])
    if hasattr(loader, "close"):
        loader.close()
    else:
        iterator._shutdown_workers()
    del iterator, loader
    return samples / seconds, None if read is None else read / total


def _rows(paths: dict[str, Path]) -> list[Row]:
    raw, encoded = paths["raw"], paths["encoded"]
    rows = [
        Row("torch, .npy files", paths["npy"], lambda: NpyFiles(paths["npy"]), _torch_loader),
        Row("LMDB raw pack", raw, lambda: _pack(raw, True), _fast_loader),
        Row("LMDB raw pack, no read advice", raw, lambda: _pack(raw, False), _fast_loader),
        Row("LMDB raw pack, sequential", raw, lambda: _pack(raw, True), _fast_loader, True),
        Row(
            "LMDB raw pack, block shuffle", raw, lambda: _pack(raw, True), _fast_loader, blocks=True
        ),
        Row(
            "torch, JPEG files",
            paths["jpeg"],
            lambda: JpegFiles(paths["jpeg"]),
            _torch_loader,
            encoded=True,
        ),
        Row("LMDB encoded pack", encoded, lambda: _pack(encoded, True), _fast_loader, encoded=True),
        Row(
            "LMDB encoded pack, no read advice",
            encoded,
            lambda: _pack(encoded, False),
            _fast_loader,
            encoded=True,
        ),
    ]
    if "raw_hdf5" in paths:
        hdf5 = paths["raw_hdf5"]
        rows.insert(3, Row("HDF5 raw pack", hdf5, lambda: _pack(hdf5, True), _fast_loader))
        rows.insert(
            4, Row("HDF5 raw pack, no read advice", hdf5, lambda: _pack(hdf5, False), _fast_loader)
        )
    return rows


def _ratio(rows: dict[str, Row], top: str, bottom: str) -> float:
    pairs = zip(rows[top].rates, rows[bottom].rates, strict=True)
    return statistics.median(a / b for a, b in pairs)


def _record_bytes(path: Path) -> float:
    from fastloader import open_pack

    with contextlib.closing(open_pack(path)) as pack:
        return os.path.getsize(path) / len(pack)


def run(
    size: str,
    workdir: Path,
    *,
    gb: float | None = None,
    samples: int | None = None,
    rounds: int | None = None,
    hdf5: bool = False,
    cgroup_mb: int | None = None,
) -> dict:
    """Build the data under ``workdir``, measure every row cold, return rows and ratios."""
    data_gb, default_samples, default_rounds = SIZES[size]
    data_gb = gb or data_gb
    count = max(2 * BATCH, int(data_gb * 1e9 / np.prod(SHAPE)))
    samples = min(count, samples or default_samples)
    rounds = rounds or default_rounds
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    needed = int(count * np.prod(SHAPE) * (3.5 if hdf5 else 2.5) * 1.1)
    if free < needed + (1 << 30):
        return {
            "comparison": "oom",
            "skipped": f"needs {needed / 1e9:.1f} GB free in {workdir}, has {free / 1e9:.1f}",
            "rows": [],
            "ratios": {},
        }
    made = time.perf_counter()
    paths = make_data(workdir, count, hdf5)
    made = time.perf_counter() - made
    rows = _rows(paths)
    rng = np.random.default_rng(0)
    data_bytes = count * int(np.prod(SHAPE))
    # half the data, so the raw pack is bigger than memory (its read advice needs the pack to
    # be more than half of what the page cache may hold:
    # NOTE [ Read advice for packs bigger than memory ])
    limit = cgroup_mb * MIB if cgroup_mb else max(data_bytes // 2, 384 * MIB)
    if data_bytes < 400e6:
        limit = 0  # too small for the workers' own memory in a cgroup of half its size
    with memory_cgroup(limit) as cgroup:
        for round_ in range(rounds):
            random_order = rng.choice(count, samples, replace=False).tolist()
            encoded_order = rng.choice(ENCODED_TIMES * count, samples, replace=False).tolist()
            start = int(rng.integers(0, count - samples + 1))
            sequential_order = list(range(start, start + samples))
            block_sampler = BlockShuffleSampler(range(count), seed=round_)
            block_order = block_sampler.epoch_order()[:samples].tolist()
            for row in rows:
                order = encoded_order if row.encoded else random_order
                if row.sequential or row.blocks:
                    order = sequential_order if row.sequential else block_order
                rate, read = measure(row, order)
                row.rates.append(rate)
                if read is not None:
                    row.read_per_sample.append(read)
            print(f"oom: round {round_ + 1}/{rounds} done", file=sys.stderr, flush=True)
    by_name = {row.name: row for row in rows}
    record = {
        "npy": data_bytes / count + 128,
        "raw": _record_bytes(paths["raw"]),
        "encoded": _record_bytes(paths["encoded"]),
        "jpeg": _record_bytes(paths["encoded"]),
    }
    table = []
    for row in rows:
        kind = "encoded" if "encoded" in row.name else "jpeg" if "JPEG" in row.name else "raw"
        read = statistics.median(row.read_per_sample) if row.read_per_sample else None
        read = read or None  # 0: reads do not show here (tmpfs, or eviction impossible)
        baseline = "torch, JPEG files" if kind in ("encoded", "jpeg") else "torch, .npy files"
        table.append(
            {
                "reader": row.name,
                "order": "sequential" if row.sequential else "blocks" if row.blocks else "random",
                "samples_per_s": statistics.median(row.rates),
                "vs_torch_files": _ratio(by_name, row.name, baseline),
                "read_kib_per_sample": None if read is None else read / 1024,
                "vs_record_read": None if read is None else read / record[kind],
            }
        )
    ratios = {
        "raw_pack_vs_torch_files": _ratio(by_name, "LMDB raw pack", "torch, .npy files"),
        "encoded_pack_vs_torch_files": _ratio(by_name, "LMDB encoded pack", "torch, JPEG files"),
        "random_vs_sequential": _ratio(by_name, "LMDB raw pack", "LMDB raw pack, sequential"),
        "raw_pack_advice_speedup": _ratio(
            by_name, "LMDB raw pack", "LMDB raw pack, no read advice"
        ),
    }
    ahead = read_ahead_path(workdir)
    return {
        "comparison": "oom",
        "config": {
            "records": count,
            "samples_per_measurement": samples,
            "rounds": rounds,
            "record_kib": {key: round(value / 1024, 1) for key, value in record.items()},
            "data_gb": round(data_bytes / 1e9, 2),
            "read_ahead_kb": int(ahead.read_text()) if ahead else None,
            "memory_limit": cgroup or "none (page cache evicted before each measurement)",
            "make_data_s": round(made, 1),
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "rows": table,
        "ratios": ratios,
        "notes": [
            "cold reads: each measurement's files evicted with posix_fadvise(DONTNEED) first",
            "goals (issue 23): raw pack >= 1.5x torch files; encoded >= 1.0x; random >= 0.8x "
            "sequential; read per sample <= 1.5x the record",
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.oom``: build the data, print the table, clean up."""
    from benchmarks import report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.oom", description=__doc__)
    parser.add_argument("--gb", type=float, default=2.0, help="raw data size (default 2)")
    parser.add_argument("--samples", type=int, default=1536, help="samples per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hdf5", action="store_true", help="also a raw HDF5 pack")
    parser.add_argument("--cgroup-mb", type=int, default=None, help="memory cgroup limit")
    parser.add_argument("--read-ahead-kb", type=int, default=None, help="set it (root) for the run")
    parser.add_argument("--workdir", type=Path, default=Path("oom-work"))
    parser.add_argument("--keep-work", action="store_true")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    ahead = read_ahead_path(args.workdir)
    previous = ahead.read_text().strip() if ahead else None
    try:
        if args.read_ahead_kb is not None:
            if ahead is None:
                parser.error("no read_ahead_kb for the disk of --workdir")
            ahead.write_text(str(args.read_ahead_kb))
        result = run(
            "full",
            args.workdir,
            gb=args.gb,
            samples=args.samples,
            rounds=args.rounds,
            hdf5=args.hdf5,
            cgroup_mb=args.cgroup_mb,
        )
    finally:
        if args.read_ahead_kb is not None and ahead is not None and previous is not None:
            ahead.write_text(previous)
        if not args.keep_work:
            shutil.rmtree(args.workdir, ignore_errors=True)
    print(report.format_table(result["rows"], markdown=True))
    print()
    for key, value in {**result.get("config", {}), **result["ratios"]}.items():
        print(f"- {key}: {value:.2f}" if isinstance(value, float) else f"- {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
