"""A user's own pose-style HDF5 file read in place: fastloader's HDF5Dataset vs hand-written h5py.

The file is what a pose-estimation user keeps (issue 18): ``image`` N x 40 x 40 x 3 uint8,
``part`` N x 14 x 2 float32, ``S`` N x 14 x 3 float64 and ``imagename`` N fixed-length strings,
written by h5py's ``create_dataset`` (contiguous, uncompressed). Every row reads random-order
epochs with 2 workers, in batches of 64 and of 256:

- ``h5py Dataset, torch DataLoader``: the careful hand-written Dataset users write (the file
  opened lazily in each worker, dataset handles kept, one ``f[name][i]`` per field), read by
  torch's DataLoader with persistent workers (the baseline);
- ``h5py Dataset, fastloader.DataLoader``: the same Dataset through fastloader's loader;
- ``fastloader.HDF5Dataset``: ``fastloader.HDF5Dataset(path)`` through fastloader's loader.

Reported: samples/s of each (median over interleaved rounds, one epoch per row per round,
loaders made once and warmed up), and the median of per-round ratios to the baseline (the
goal: >= 3x). With ``mosaicml-streaming`` installed, the same samples are also packed into a
fastloader LMDB and HDF5 pack (image as a raw field) and MosaicML's MDS (``ndarray`` columns and
``str``), and read back the same way: the read ratio (goal >= 1.5x), pack seconds and sizes.

Then packs of many fields against the file they were made from (the issue's 64x64 samples,
old and new layout, and these samples by columns), and token windows against a NumPy memmap
dataset (issue 38: ``benchmarks/column_packs.py``).

Run alone: ``python -m benchmarks --only any_sample``.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks import column_packs, peer_rows
from benchmarks._stats import paired_ratio
from benchmarks.formats import close_loader

SIZES = {"tiny": (400, 2), "quick": (20_000, 5), "full": (40_000, 7)}  # samples, rounds
WORKERS = 2
BATCHES = (64, 256)  # the per-batch costs of a loader (IPC, shared memory) weigh less at 256
SIDE = 40
MIB = 1024 * 1024


def make_pose_file(path: Path, count: int) -> Path:
    """The pose-style file, written in blocks (as a converter script would)."""
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as file:
        image = file.create_dataset("image", (count, SIDE, SIDE, 3), np.uint8)
        part = file.create_dataset("part", (count, 14, 2), np.float32)
        s = file.create_dataset("S", (count, 14, 3), np.float64)
        names = file.create_dataset("imagename", (count,), "S16")
        for start in range(0, count, 4096):
            end = min(count, start + 4096)
            image[start:end] = rng.integers(0, 256, (end - start, SIDE, SIDE, 3), np.uint8)
            part[start:end] = rng.random((end - start, 14, 2), np.float32) * SIDE
            s[start:end] = rng.random((end - start, 14, 3))
            names[start:end] = [f"im{index:08d}.jpg".encode() for index in range(start, end)]
    return path


class H5pyPoseDataset(Dataset):
    """The careful hand-written h5py Dataset: opened lazily in each worker, handles kept."""

    FIELDS = ("image", "part", "S", "imagename")

    def __init__(self, path: Path) -> None:
        self.path = path
        with h5py.File(path, "r") as file:
            self.length = len(file["image"])
        self.file = None
        self.datasets: dict[str, Any] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if self.file is None:  # in the worker: never share a handle across a fork
            self.file = h5py.File(self.path, "r")
            self.datasets = {name: self.file[name] for name in self.FIELDS}
        sample = {name: self.datasets[name][index] for name in self.FIELDS}
        sample["imagename"] = sample["imagename"].decode()
        return sample

    def __getstate__(self) -> dict:
        return {**self.__dict__, "file": None, "datasets": {}}


def _epoch(loader: Any) -> float:
    started = time.perf_counter()
    samples = 0
    for batch in loader:
        samples += len(batch["imagename"])
    return samples / (time.perf_counter() - started)


def _interleaved(loaders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for loader in loaders.values():
        _epoch(loader)  # warm-up: workers started, file opened, pages cached
    for number in range(rounds):
        names = list(loaders) if number % 2 == 0 else list(reversed(loaders))
        for name in names:
            rates[name].append(_epoch(loaders[name]))
    return rates


def _rows(rates: dict[str, list[float]], baseline: str, batch: int, sizes: dict) -> list[dict]:
    rows = []
    for name, rate in rates.items():
        row = {"reader": name, "batch": batch, "samples_per_s": round(statistics.median(rate), 1)}
        if name in sizes:
            row["size_mib"] = round(sizes[name] / MIB, 1)
        if name != baseline:
            row["vs_baseline"] = round(paired_ratio(rate, rates[baseline]), 2)
        rows.append(row)
    return rows


def run(size: str, workdir: Path) -> dict:
    """Run the comparison at ``size`` ("tiny", "quick", "full") with data in ``workdir``."""
    count, rounds = SIZES[size]
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = make_pose_file(workdir / f"pose-{count}.h5", count)
    rows, ratios = [], {}
    for batch in BATCHES:
        batch_rows, batch_ratios = _hdf5_in_place(path, batch, rounds)
        rows += batch_rows
        ratios.update(batch_ratios)
    notes = [
        f"{count} samples ({SIDE}x{SIDE}x3 uint8 image, 14x2 float32, 14x3 float64, a name), "
        f"{WORKERS} workers, random order, batches of {' and '.join(map(str, BATCHES))}, "
        f"{rounds} interleaved rounds"
    ]
    parts = (  # issue 38: the 64x64 samples, these samples, token windows
        column_packs.pose_rows,
        lambda size, workdir: column_packs.pose_rows(size, workdir, path),
        column_packs.token_rows,
    )
    for part in parts:
        result = part(size, workdir)
        rows += result["rows"]
        ratios.update(result["ratios"])
        notes += result["notes"]
    peers = peer_rows.guarded(peer_rows.any_sample, size, workdir)  # issue 38: peers
    ratios.update(peers["ratios"])
    notes += peers["notes"]
    packed = _packed_vs_mds(path, workdir, count, rounds)
    if packed is None:
        notes.append("MDS comparison skipped: mosaicml-streaming is not installed")
    else:
        rows += packed["rows"]
        ratios.update(packed["ratios"])
    return {"rows": rows, "peer_rows": peers["rows"], "ratios": ratios, "notes": notes}


def _hdf5_in_place(path: Path, batch: int, rounds: int) -> tuple[list[dict], dict]:
    import fastloader

    common = {"batch_size": batch, "num_workers": WORKERS, "shuffle": True}
    baseline = "h5py Dataset, torch DataLoader"
    loaders = {
        baseline: TorchDataLoader(H5pyPoseDataset(path), persistent_workers=True, **common),
        "fastloader.HDF5Dataset": fastloader.DataLoader(fastloader.HDF5Dataset(path), **common),
    }
    if batch == BATCHES[0]:
        loaders["h5py Dataset, fastloader.DataLoader"] = fastloader.DataLoader(
            H5pyPoseDataset(path), **common
        )
    try:
        rates = _interleaved(loaders, rounds)
    finally:
        for loader in loaders.values():
            close_loader(loader)
    ratios = {
        f"hdf5dataset_vs_h5py_batch{batch}": round(
            paired_ratio(rates["fastloader.HDF5Dataset"], rates[baseline]), 2
        )
    }
    return _rows(rates, baseline, batch, {}), ratios


def _packed_vs_mds(path: Path, workdir: Path, count: int, rounds: int) -> dict | None:
    try:
        from streaming import MDSWriter, StreamingDataset
    except ImportError:
        return None
    import fastloader
    from fastloader.formats.hdf5_foreign import HDF5File

    source = HDF5File(path)
    lmdb_path = workdir / f"pose-{count}.lmdb"
    mds_dir = workdir / f"pose-{count}-mds"
    lmdb_path.unlink(missing_ok=True)
    shutil.rmtree(mds_dir, ignore_errors=True)
    h5_path = workdir / f"pose-{count}.pack.h5"
    h5_path.unlink(missing_ok=True)
    started = time.perf_counter()
    fastloader.pack(source, lmdb_path, schema={"image": "image"}, store="raw", workers=WORKERS)
    pack_seconds = time.perf_counter() - started
    started = time.perf_counter()
    fastloader.pack(source, h5_path, schema={"image": "image"}, store="raw", workers=WORKERS)
    h5_seconds = time.perf_counter() - started
    columns = {
        "image": "ndarray:uint8",
        "part": "ndarray:float32",
        "S": "ndarray:float64",
        "imagename": "str",
    }
    started = time.perf_counter()
    with MDSWriter(out=str(mds_dir), columns=columns, size_limit=1 << 26) as writer:
        for start in range(0, count, 1024):
            for sample in source.read_many(range(start, min(count, start + 1024))):
                writer.write(sample)
    mds_seconds = time.perf_counter() - started
    mds_bytes = sum(file.stat().st_size for file in mds_dir.rglob("*") if file.is_file())
    baseline = "MDS StreamingDataset, torch DataLoader"
    ours, ours_h5 = "fastloader LMDB pack", "fastloader HDF5 pack"
    sizes = {baseline: mds_bytes, ours: lmdb_path.stat().st_size, ours_h5: h5_path.stat().st_size}
    rows, ratios = [], {}
    for batch in BATCHES:
        common = {"batch_size": batch, "num_workers": WORKERS}
        mds = StreamingDataset(local=str(mds_dir), shuffle=True, batch_size=batch)
        loaders = {
            baseline: TorchDataLoader(mds, persistent_workers=True, **common),
            ours: fastloader.DataLoader(
                fastloader.LMDBDataset(lmdb_path, decode="numpy"), shuffle=True, **common
            ),
            ours_h5: fastloader.DataLoader(
                fastloader.HDF5Dataset(h5_path, decode="numpy"), shuffle=True, **common
            ),
        }
        try:
            rates = _interleaved(loaders, rounds)
        finally:
            for loader in loaders.values():
                close_loader(loader)
        batch_rows = _rows(rates, baseline, batch, sizes)
        batch_rows[0]["pack_s"] = round(mds_seconds, 1)
        batch_rows[1]["pack_s"] = round(pack_seconds, 1)
        batch_rows[2]["pack_s"] = round(h5_seconds, 1)
        rows += batch_rows
        for name, key in ((ours, "lmdb"), (ours_h5, "hdf5")):
            ratios[f"{key}_pack_vs_mds_read_batch{batch}"] = round(
                paired_ratio(rates[name], rates[baseline]), 2
            )
    ratios["lmdb_pack_seconds_over_mds"] = round(pack_seconds / mds_seconds, 2)
    ratios["hdf5_pack_seconds_over_mds"] = round(h5_seconds / mds_seconds, 2)
    ratios["lmdb_bytes_over_mds"] = round(sizes[ours] / mds_bytes, 3)
    ratios["hdf5_bytes_over_mds"] = round(sizes[ours_h5] / mds_bytes, 3)
    return {"rows": rows, "ratios": ratios}
