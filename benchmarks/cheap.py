"""Cheap samples: fastloader vs torch's DataLoader where loading costs microseconds.

Image samples (hundreds of microseconds each) hide a loader's own cost per sample; these do
not. Each dataset is iterated by torch's DataLoader (default, and ``persistent_workers=True``
with workers) and ``fastloader.DataLoader`` with the same arguments (``shuffle=True``), with
0 and 2 workers; the loaders take turns epoch by epoch (interleaved rounds) and each ratio is
the median of the per-round ratios of samples/s:

- ``index``: ``dataset[i]`` returns ``i`` (batch 256);
- ``cifar``: in-memory uint8 32x32x3 tensors, random crop with 4 pixels of padding and a random
  flip done with torch ops (batch 256);
- ``tokens``: 2048-token windows (and their next-token targets) sliced from a uint16 memmap, as
  in LLM pre-training (batch 16);
- ``noop``: a batch of one sample that costs nothing: the loaders' own cost per batch, in
  microseconds (no ratio of samples/s; per-batch times are compared instead).

Run alone: ``python -m benchmarks --only cheap``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks._progress import note
from benchmarks._stats import paired_ratio, rotated, significant
from fastloader import DataLoader

SIZES = {
    #        rounds, index samples, cifar samples, token windows, noop batches
    "tiny": (2, 2048, 512, 64, 200),
    "quick": (5, 65_536, 8192, 1024, 2000),
    "full": (11, 131_072, 16_384, 2048, 2000),
}
WINDOW = 2048
WORKER_COUNTS = (0, 2)


class IndexDataset(Dataset):
    """``dataset[i]`` is ``i``: a loader's cost per sample and nothing else."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class CifarLike(Dataset):
    """uint8 32x32x3 images in memory; random crop (padding 4) and flip with torch ops."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 10, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = F.pad(self.images[index].permute(2, 0, 1), (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        image = image[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, self.labels[index]


class TokenWindows(Dataset):
    """Windows of ``WINDOW`` tokens and their next-token targets from a uint16 memmap."""

    def __init__(self, path: Path, windows: int) -> None:
        self.path = path
        self.windows = windows
        self._tokens: np.memmap | None = None  # opened lazily, in the process that reads

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = index * WINDOW
        window = torch.from_numpy(self._tokens[start : start + WINDOW + 1].astype(np.int64))
        return window[:-1], window[1:]


class Noop(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return 0


def _token_file(workdir: Path, windows: int) -> Path:
    path = workdir / f"tokens-{windows}.u16"
    if not path.exists():
        tokens = np.random.default_rng(0).integers(0, 50_000, windows * WINDOW + 1)
        tokens.astype(np.uint16).tofile(path)
    return path


def _loaders(dataset: Dataset, batch: int, num_workers: int) -> dict[str, Any]:
    common = dict(batch_size=batch, shuffle=True, num_workers=num_workers)
    loaders = {"torch": TorchDataLoader(dataset, **common)}
    if num_workers:
        loaders["torch_persistent"] = TorchDataLoader(dataset, persistent_workers=True, **common)
    loaders["fastloader"] = DataLoader(dataset, seed=0, **common)
    return loaders


def _epoch_seconds(loader: Any) -> float:
    started = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - started


def _interleaved(loaders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Seconds per epoch of each loader, the loaders taking turns (order rotated per round)."""
    for loader in loaders.values():
        _epoch_seconds(loader)  # warm-up: workers started, pages cached
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    names = list(loaders)
    for round_ in range(rounds):
        for name in rotated(names, round_):
            seconds[name].append(_epoch_seconds(loaders[name]))
    return seconds


def _close(loaders: dict[str, Any]) -> None:
    for loader in loaders.values():
        if isinstance(loader, DataLoader):
            loader.close()
        else:
            loader._iterator = None  # stops torch's persistent workers


def _compare(name: str, dataset: Dataset, batch: int, rounds: int) -> list[dict]:
    rows = []
    for num_workers in WORKER_COUNTS:
        note(f"{name}, {num_workers} workers")
        loaders = _loaders(dataset, batch, num_workers)
        try:
            seconds = _interleaved(loaders, rounds)
        finally:
            _close(loaders)
        samples = len(dataset)
        row: dict[str, Any] = {"dataset": name, "num_workers": num_workers, "batch_size": batch}
        for loader_name, times in seconds.items():
            row[f"{loader_name}_samples_per_s"] = round(samples / statistics.median(times), 1)
        for base in ("torch", "torch_persistent"):
            if base in seconds:  # samples/s ratio = inverse ratio of epoch times
                row[f"vs_{base}"] = significant(paired_ratio(seconds[base], seconds["fastloader"]))
        row["spread_vs_torch"] = _spread(seconds["torch"], seconds["fastloader"])
        rows.append(row)
    return rows


def _spread(base: list[float], ours: list[float]) -> str:
    ratios = sorted(b / o for b, o in zip(base, ours, strict=True))
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


def _per_batch_us(batches: int, rounds: int) -> list[dict]:
    """Microseconds per batch of one free sample: the loader's own bookkeeping."""
    rows = []
    for num_workers in WORKER_COUNTS:
        note(f"noop batches, {num_workers} workers")
        loaders = _loaders(Noop(batches), 1, num_workers)
        try:
            seconds = _interleaved(loaders, rounds)
        finally:
            _close(loaders)
        row: dict[str, Any] = {"num_workers": num_workers}
        for name, times in seconds.items():
            row[f"{name}_us_per_batch"] = round(statistics.median(times) / batches * 1e6, 2)
        row["vs_torch"] = significant(paired_ratio(seconds["torch"], seconds["fastloader"]))
        rows.append(row)
    return rows


def run(size: str, workdir: Path) -> dict:
    """Run the cheap-sample comparison at ``size`` ("tiny", "quick", "full")."""
    rounds, index_samples, cifar_samples, windows, noop_batches = SIZES[size]
    torch.manual_seed(0)
    rows = _compare("index", IndexDataset(index_samples), 256, rounds)
    rows += _compare("cifar", CifarLike(cifar_samples), 256, rounds)
    tokens = TokenWindows(_token_file(workdir, windows), windows)
    rows += _compare("tokens", tokens, 16, rounds)
    per_batch = _per_batch_us(noop_batches, rounds)
    ratios = {}
    for row in rows:
        for base in ("torch", "torch_persistent"):
            if f"vs_{base}" in row:
                ratios[f"{row['dataset']}_{row['num_workers']}w_vs_{base}"] = row[f"vs_{base}"]
    return {
        "comparison": "cheap",
        "config": {"rounds": rounds, "shuffle": True, "window": WINDOW},
        "rows": rows,
        "per_batch_rows": per_batch,
        "ratios": ratios,
        "notes": [
            "vs_*: fastloader samples/s over the baseline's, median of per-round ratios "
            f"({rounds} interleaved rounds after a warm-up epoch); spread: lowest-highest "
            "round ratio vs torch",
            "with 0 workers torch's persistent_workers does not apply: vs_torch only",
            "per batch: batch_size=1, a sample that costs nothing; microseconds per batch "
            "(median epoch / batches); vs_torch = torch's time over fastloader's",
        ],
    }
