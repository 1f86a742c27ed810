"""The transport: batches from worker processes to the main process (issue 30's five data kinds).

Each data kind runs with ``num_workers`` 0, 1 and 2 (the demo, size quick: 0 and 2) through
torch's DataLoader (``persistent_workers=True`` with workers), ``fastloader.DataLoader``
(batches through shared-memory slots: NOTE [ Batch transport ] in
fastloader/loader/transport/__init__.py) and, at sizes tiny and full, ``fastloader.DataLoader``
with torch's transport (``WorkerPoolIter.slots = False``, ``pipes.ENABLED = False``: pickled
batches, a shared-memory segment per tensor, queue feeder threads) and with ``prefetch_factor=2``
(torch's fixed depth, against the depth from the first batch's bytes: NOTE [ Prefetch depth
by batch bytes ]). The loaders take turns
epoch by epoch (interleaved rounds, after a warm-up epoch that starts the workers; without
workers five times as many rounds, ``IN_PROCESS_ROUNDS``); each ratio is the median
of the per-round ratios of samples/s. Also per loader: the main process's CPU time per batch
(``time.process_time``, all its threads) — what a GPU step loses to loading.

- ``pose64``/``pose256``: a user's pose-style HDF5 file (benchmarks/any_sample.py's, 4 fields)
  read in place by ``HDF5Dataset`` (batches of 64 and, except in the demo, 256); the
  ``plain loop`` row is ``dataset.__getitems__(indices)`` + fastloader's ``default_collate``
  in the same process, a shuffled order;
- ``tokens``: 2048-token windows and targets sliced from a uint16 memmap (batch 32);
- ``index``: ``dataset[i]`` returns ``i`` (batch 256);
- ``images``: one 3x224x224 uint8 tensor per sample, a decoded image (batch 64).

Run alone: ``python -m benchmarks --only transport``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks._progress import note
from benchmarks._stats import paired_ratio, rotated
from benchmarks.any_sample import make_pose_file
from benchmarks.cheap import IndexDataset, TokenWindows, _token_file
from fastloader import DataLoader, HDF5Dataset
from fastloader.datasets.collate import default_collate
from fastloader.loader.iterators.worker_pool import WorkerPoolIter
from fastloader.loader.transport import pipes

# rounds, pose samples, token windows, index samples, images
SIZES = {
    "tiny": (1, 512, 64, 2048, 128),
    "quick": (5, 2048, 2048, 65_536, 1024),  # the demo: kept short (issue 40)
    "full": (7, 20_000, 4096, 131_072, 4096),
}
#: num_workers compared at each size; and whether fastloader with torch's transport runs too
#: (the quick size is the demo's table: 0 and 2 workers only)
WORKER_COUNTS = {"tiny": (0, 1, 2), "quick": (0, 2), "full": (0, 1, 2)}
WITH_PICKLED = {"tiny": True, "quick": False, "full": True}
#: rounds without workers, per round with: their epochs take 30-70 ms, and a busy moment of the
#: box moved a 7-round median by 5 % (tokens, 0 workers: 0.88x-0.97x torch in three runs)
IN_PROCESS_ROUNDS = 5
TORCH, OURS, PICKLED, PLAIN = "torch", "fastloader", "fastloader_pickled", "plain_loop"
#: fastloader with torch's fixed prefetch_factor=2 (NOTE [ Prefetch depth by batch bytes ])
DEPTH2 = "fastloader_prefetch2"
IN_PROCESS = "fastloader_0w"  # fastloader in the main process, in the rounds with workers


class Images(Dataset):
    """One decoded image per sample: a 3x224x224 uint8 tensor (16 distinct ones, in memory)."""

    def __init__(self, n: int) -> None:
        self.n = n
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(
            0, 256, (16, 3, 224, 224), dtype=torch.uint8, generator=generator
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index % 16].clone()


class PlainLoop:
    """``dataset.__getitems__`` + ``default_collate`` over a shuffled order, no loader (the
    faster of the two default collates: fastloader's stacks NumPy fields with ``np.stack``)."""

    def __init__(self, dataset: Any, batch: int) -> None:
        self.dataset = dataset
        self.batch = batch
        self.generator = np.random.default_rng(0)

    def __iter__(self) -> Any:
        order = self.generator.permutation(len(self.dataset))
        for start in range(0, len(order), self.batch):
            indices = order[start : start + self.batch].tolist()
            yield default_collate(self.dataset.__getitems__(indices))


def _epoch(loader: Any) -> tuple[float, float, int]:
    """Wall seconds, main-process CPU seconds and batches of one epoch."""
    started, cpu = time.perf_counter(), time.process_time()
    batches = 0
    for _ in loader:
        batches += 1
    return time.perf_counter() - started, time.process_time() - cpu, batches


def _loaders(
    dataset: Dataset, batch: int, workers: int, plain: bool, pickled: bool
) -> dict[str, Any]:
    common: dict[str, Any] = dict(batch_size=batch, shuffle=True, num_workers=workers)
    loaders: dict[str, Any] = {
        TORCH: TorchDataLoader(dataset, persistent_workers=workers > 0, **common),
        OURS: DataLoader(dataset, seed=0, **common),
    }
    if workers and pickled:
        loaders[PICKLED] = DataLoader(dataset, seed=0, **common)
        loaders[DEPTH2] = DataLoader(dataset, seed=0, prefetch_factor=2, **common)
    if plain and workers == 0:
        loaders[PLAIN] = PlainLoop(dataset, batch)
    if plain and workers:  # the goal's ratio, paired round by round like the others
        loaders[IN_PROCESS] = DataLoader(dataset, seed=0, batch_size=batch, shuffle=True)
    return loaders


def _interleaved(loaders: dict[str, Any], rounds: int) -> dict[str, list[tuple]]:
    for name, loader in loaders.items():  # warm-up: workers started, pages cached
        # read when the pool starts: torch's transport is pickled batches and feeder threads
        WorkerPoolIter.slots = pipes.ENABLED = name != PICKLED
        try:
            _epoch(loader)
        finally:
            WorkerPoolIter.slots = pipes.ENABLED = True
    results: dict[str, list[tuple]] = {name: [] for name in loaders}
    names = list(loaders)
    for round_ in range(rounds):
        for name in rotated(names, round_):
            results[name].append(_epoch(loaders[name]))
    return results


def _close(loaders: dict[str, Any]) -> None:
    for loader in loaders.values():
        if isinstance(loader, DataLoader):
            loader.close()
        elif isinstance(loader, TorchDataLoader):
            loader._iterator = None  # stops torch's persistent workers


def _compare(kind: str, dataset: Dataset, batch: int, size: str, plain: bool = False) -> list:
    """Rows for each worker count; ``plain``: also against a plain loop (without workers) and
    fastloader in the main process (with workers)."""
    rows = []
    for workers in WORKER_COUNTS[size]:
        note(f"{kind}, {workers} workers")
        rounds = SIZES[size][0] * (1 if workers else IN_PROCESS_ROUNDS)
        loaders = _loaders(dataset, batch, workers, plain, WITH_PICKLED[size])
        try:
            results = _interleaved(loaders, rounds)
        finally:
            _close(loaders)
        row: dict[str, Any] = {"data": kind, "num_workers": workers, "batch_size": batch}
        seconds = {name: [r[0] for r in rounds_] for name, rounds_ in results.items()}
        for name in results:
            row[f"{name}_samples_per_s"] = round(len(dataset) / statistics.median(seconds[name]))
        for name, rounds_ in results.items():
            cpu = statistics.median(r[1] / max(1, r[2]) for r in rounds_)
            row[f"{name}_main_cpu_ms_per_batch"] = round(cpu * 1e3, 3)
        for name in seconds:
            if name != OURS:  # samples/s ratio = inverse ratio of epoch times
                row[f"vs_{name}"] = round(paired_ratio(seconds[name], seconds[OURS]), 3)
        rows.append((row, seconds))
    return rows


def _in_process_ratios(kind: str, rows: list) -> dict[str, float]:
    """fastloader with workers vs fastloader in the main process, both in the same rounds:
    the median of per-round ratios (a load that changes between blocks of rows moves both)."""
    return {
        f"{kind}_{row['num_workers']}w_vs_fastloader_0w": row[f"vs_{IN_PROCESS}"]
        for row, _ in rows
        if f"vs_{IN_PROCESS}" in row
    }


def run(size: str, workdir: Path) -> dict:
    """Run the transport comparison at ``size`` ("tiny", "quick", "full")."""
    rounds, poses, windows, indices, images = SIZES[size]
    torch.manual_seed(0)
    tokens = _token_file(workdir, windows)
    pose = HDF5Dataset(make_pose_file(workdir / f"pose-{poses}.h5", poses))
    measured = {"pose64": _compare("pose64", pose, 64, size, plain=True)}
    if size != "quick":  # the demo's table: one batch size of pose
        measured["pose256"] = _compare("pose256", pose, 256, size, plain=True)
    measured["tokens"] = _compare("tokens", TokenWindows(tokens, windows), 32, size)
    measured["index"] = _compare("index", IndexDataset(indices), 256, size)
    measured["images"] = _compare("images", Images(images), 64, size)
    rows, ratios = [], {}
    for kind, kind_rows in measured.items():
        for row, _ in kind_rows:
            rows.append(row)
            for base in (TORCH, PICKLED, PLAIN, DEPTH2):
                if f"vs_{base}" in row:
                    ratios[f"{kind}_{row['num_workers']}w_vs_{base}"] = row[f"vs_{base}"]
        if kind.startswith("pose"):
            ratios.update(_in_process_ratios(kind, kind_rows))
    return {
        "comparison": "transport",
        "config": {
            "rounds": rounds,
            "rounds_in_process": rounds * IN_PROCESS_ROUNDS,
            "shuffle": True,
            "sizes": SIZES[size],
            "num_workers": WORKER_COUNTS[size],
        },
        "rows": rows,
        "ratios": ratios,
        "notes": [
            "vs_*: fastloader's samples/s over the named loader's, median of per-round ratios "
            f"({rounds} interleaved rounds after a warm-up epoch; {rounds * IN_PROCESS_ROUNDS} "
            "without workers)",
            "*_vs_fastloader_0w: fastloader with workers over fastloader in the main process "
            "(fastloader_0w, interleaved in the same rounds), median of per-round ratios",
            "torch: persistent_workers=True with workers; fastloader_pickled (sizes tiny, full): "
            "fastloader with torch's transport (WorkerPoolIter.slots = False, pipes.ENABLED "
            "= False: pickled batches, queue feeder threads)",
            "*_main_cpu_ms_per_batch: the main process's CPU time (time.process_time, all its "
            "threads) per batch, median over rounds",
            "plain_loop: dataset.__getitems__ + default_collate in one process, same batches",
            "fastloader_prefetch2 (sizes tiny, full): fastloader with prefetch_factor=2, torch's "
            "fixed depth, instead of the depth from the first batch's bytes",
        ],
    }
