"""Packs of many fields against the file they were made from (issue 38), for ``any_sample``.

Pose-style samples as the issue's user had them: ``image`` N x 64 x 64 x 3 uint8,
``keypoints`` N x 17 x 2 float32, ``name`` N fixed-length strings, in an HDF5 file written by
h5py. The file is packed with ``fastloader.pack(path, dst)`` into LMDB and HDF5 packs of the
column layout (format 5, the default) and of the record layout (format 4, ``layout="records"``:
what earlier releases wrote), and every one is read with ``fastloader.DataLoader`` (random
order, batches of 64 and 256, 0 and 2 workers, checksums on, persistent workers made once and
warmed up by one epoch), in interleaved rounds; reported: samples/s (median) and the median of
per-round ratios to ``HDF5Dataset`` reading the file in place (the goal: >= 1.2x), and each
pack's size over the file's (goal: <= 1.1x).

Token windows: a ``.npy`` of int32 tokens cut into windows of 512, read by a NumPy memmap
dataset (``{"tokens": np.array(memmap[i * 512:(i + 1) * 512])}``) and by an LMDB and HDF5
pack of the same windows (goal: >= 1.0x).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from benchmarks._stats import paired_ratio
from benchmarks.formats import close_loader

#: samples, rounds, (batch sizes), (worker counts) per size
SIZES = {
    "tiny": (300, 1, (64,), (0,)),
    "quick": (20_000, 3, (64, 256), (0, 2)),
    "full": (20_000, 5, (64, 256), (0, 2)),
}
WINDOW = 512
IN_PLACE = "HDF5Dataset, the file in place"
MIB = 1024 * 1024


def make_pose64(path: Path, count: int) -> Path:
    """The issue's pose-style file, written in blocks."""
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as file:
        image = file.create_dataset("image", (count, 64, 64, 3), np.uint8)
        keypoints = file.create_dataset("keypoints", (count, 17, 2), np.float32)
        names = file.create_dataset("name", (count,), "S16")
        for start in range(0, count, 4096):
            end = min(count, start + 4096)
            image[start:end] = rng.integers(0, 256, (end - start, 64, 64, 3), np.uint8)
            keypoints[start:end] = rng.random((end - start, 17, 2), np.float32) * 64
            names[start:end] = [f"im{index:08d}.jpg".encode() for index in range(start, end)]
    return path


class TokenWindows:
    """Windows of a ``.npy`` of tokens read through a NumPy memmap, one copy per window."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tokens: Any = None
        self.length = len(np.load(path, mmap_mode="r")) // WINDOW

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if self.tokens is None:
            self.tokens = np.load(self.path, mmap_mode="r")
        return {"tokens": np.array(self.tokens[index * WINDOW : (index + 1) * WINDOW])}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "tokens": None}


def _epoch(loader: Any, key: str) -> float:
    started = time.perf_counter()
    samples = 0
    for batch in loader:
        samples += len(batch[key])
    return samples / (time.perf_counter() - started)


def _interleaved(loaders: dict[str, Any], rounds: int, key: str) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for loader in loaders.values():
        _epoch(loader, key)  # warm-up: workers started, files opened, blocks checked
    for number in range(rounds):
        names = list(loaders) if number % 2 == 0 else list(reversed(loaders))
        for name in names:
            rates[name].append(_epoch(loaders[name], key))
    return rates


def _compare(
    datasets: dict[str, Any], baseline: str, key: str, rounds: int, batches, workers
) -> tuple[list[dict], dict]:
    import fastloader

    rows, ratios = [], {}
    for batch in batches:
        for count in workers:
            common = {"batch_size": batch, "num_workers": count, "shuffle": True}
            loaders = {name: fastloader.DataLoader(ds, **common) for name, ds in datasets.items()}
            try:
                rates = _interleaved(loaders, rounds, key)
            finally:
                for loader in loaders.values():
                    close_loader(loader)
            for name, rate in rates.items():
                row = {
                    "reader": name,
                    "batch": batch,
                    "workers": count,
                    "samples_per_s": round(statistics.median(rate), 1),
                }
                if name != baseline:
                    row["vs_baseline"] = round(paired_ratio(rate, rates[baseline]), 2)
                rows.append(row)
    return rows, ratios


def _packs(
    source: Any, workdir: Path, stem: str, layouts=("columns", "records")
) -> dict[str, Path]:
    import fastloader

    packs = {}
    for layout in layouts:
        for suffix, backend in ((".lmdb", "LMDB"), (".h5", "HDF5")):
            target = workdir / f"{stem}-{layout}{suffix}"
            if not target.exists():
                fastloader.pack(source, target, workers=2, layout=layout)
            kind = "columns (format 5)" if layout == "columns" else "records (format 4)"
            name = f"{backend} pack, {kind}"
            packs[name] = target
    return packs


def pose_rows(size: str, workdir: Path, source: Path | None = None) -> dict:
    """The pose comparison: rows, ratios and notes. ``source``: another pose-style file (the
    benchmark's own 40x40 samples), read against its packs by columns only (``samples`` names
    it in the rows, and ``pose40`` in the ratios); None: the issue's 64x64 file, both layouts."""
    import fastloader

    count, rounds, batches, workers = SIZES[size]
    tag, layouts = "pose", ("columns", "records")
    if source is None:
        source = make_pose64(workdir / f"pose64-{count}.h5", count)
    else:
        tag, layouts = "pose40", ("columns",)
    packs = _packs(source, workdir, source.stem, layouts)
    datasets = {IN_PLACE: fastloader.HDF5Dataset(source)}
    datasets.update({name: fastloader.open_pack(path) for name, path in packs.items()})
    with h5py.File(source, "r") as file:
        fields = {name: file[name] for name in file}
        described = ", ".join(
            f"{name} {'x'.join(map(str, d.shape[1:])) or '()'} {d.dtype}"
            for name, d in fields.items()
        )
        key = next(name for name, d in fields.items() if d.ndim == 1)
    rows, ratios = _compare(datasets, IN_PLACE, key, rounds, batches, workers)
    for row in rows:
        row["samples"] = tag
        if row["reader"] in packs:
            row["size_over_file"] = round(
                packs[row["reader"]].stat().st_size / source.stat().st_size, 3
            )
        if "vs_baseline" in row and "columns" in row["reader"]:
            backend = row["reader"].split()[0].lower()
            name = f"{tag}_{backend}_columns_vs_in_place_b{row['batch']}_w{row['workers']}"
            ratios[name] = row["vs_baseline"]
    for name, path in packs.items():
        kind = name.split()[0].lower() + ("_columns" if "columns" in name else "_records")
        ratios[f"{tag}_{kind}_size_over_file"] = round(
            path.stat().st_size / source.stat().st_size, 3
        )
    note = (
        f"{tag}: {count} samples ({described}), batches of "
        f"{', '.join(map(str, batches))}, {', '.join(map(str, workers))} workers, "
        f"{rounds} interleaved rounds after a warm-up epoch; checksums on"
    )
    return {"rows": rows, "ratios": ratios, "notes": [note]}


def token_rows(size: str, workdir: Path) -> dict:
    """The token-window comparison: a NumPy memmap dataset against packs of its windows."""
    import fastloader

    count, rounds, batches, workers = SIZES[size]
    path = workdir / f"tokens-{count}.npy"
    if not path.exists():
        tokens = np.random.default_rng(1).integers(0, 50_000, count * WINDOW, dtype=np.int32)
        np.save(path, tokens)
    baseline = "NumPy memmap dataset"
    windows = TokenWindows(path)
    packs = _packs(windows, workdir, f"tokens-{count}", ("columns",))
    datasets = {baseline: windows}
    datasets.update({name: fastloader.open_pack(target) for name, target in packs.items()})
    rows, ratios = _compare(datasets, baseline, "tokens", rounds, batches, workers)
    for row in rows:
        if "vs_baseline" in row:
            backend = row["reader"].split()[0].lower()
            key = f"tokens_{backend}_vs_memmap_b{row['batch']}_w{row['workers']}"
            ratios[key] = row["vs_baseline"]
    note = f"tokens: {count} windows of {WINDOW} int32 tokens from a .npy"
    return {"rows": rows, "ratios": ratios, "notes": [note]}


def cpu_ratios(source: Path, rounds: int = 9, batches=(64, 256)) -> dict[str, float]:
    """Packs by columns against ``source`` read in place, 0 workers, by the main process's CPU
    time per epoch (``time.process_time``): interleaved rounds, medians of per-round ratios.
    On a shared box the CPU time moves less than the wall time with other processes' load
    (not at all with their scheduling; still with their memory traffic)."""
    import fastloader

    packs = _packs(source, source.parent, source.stem, ("columns",))
    datasets = {IN_PLACE: fastloader.HDF5Dataset(source)}
    datasets.update({name: fastloader.open_pack(path) for name, path in packs.items()})
    with h5py.File(source, "r") as file:
        key = next(name for name in file if file[name].ndim == 1)
    ratios = {}
    for batch in batches:
        loaders = {
            name: fastloader.DataLoader(ds, batch_size=batch, shuffle=True)
            for name, ds in datasets.items()
        }
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for number in range(rounds + 1):  # the first round warms up
            names = list(loaders) if number % 2 == 0 else list(reversed(loaders))
            for name in names:
                started, samples = time.process_time(), 0
                for got in loaders[name]:
                    samples += len(got[key])
                if number:
                    rates[name].append(samples / (time.process_time() - started))
        for name in packs:
            ratios[f"{name}, b{batch}, w0, CPU"] = round(
                paired_ratio(rates[name], rates[IN_PLACE]), 2
            )
    return ratios


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.column_packs SOURCE.h5 [--rounds N]``: ``cpu_ratios`` printed."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("source", type=Path, help="an HDF5 file of pose-style samples")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    args = parser.parse_args(argv)
    for name, ratio in cpu_ratios(args.source, args.rounds).items():
        print(f"{name}: {ratio:.2f}x the file in place")


if __name__ == "__main__":
    main()
