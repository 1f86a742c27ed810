"""fastloader.DataLoader vs torch's DataLoader (default and persistent_workers=True).

Measured in one run on the same in-memory JPEG photos (decode + resize per sample, as an image
dataset does), with a consumer that spends a fixed time per batch like a training step:

- time to the first batch of each epoch (the epoch-boundary stall),
- steady throughput (samples/s after the first batch of each epoch),
- a dataset that pays a start-up cost in every new worker (like opening a large file),
- the per-sample cost of fastloader's seeding.

Run alone: ``python -m benchmarks --only loader``.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks._photos import photo_jpegs
from benchmarks._progress import note
from benchmarks._stats import paired_ratio, significant
from fastloader import DataLoader
from fastloader.loader.seeding import seed_rngs
from fastloader.sampling.seeds import sample_seed

SIZES = {
    #        samples, batch, throughput rounds, epochs (epoch-start run), startup_s, seeding samples
    "tiny": (64, 16, 1, 3, 0.05, 2_000),
    "quick": (384, 32, 3, 3, 0.3, 8_000),
    "full": (1536, 32, 16, 6, 1.0, 100_000),
}
#: The training step of the epoch-start run, in loader batch intervals: > 1 so the loader keeps
#: up, as it must for the epoch start to be the only place training waits.
STEP_IN_BATCH_INTERVALS = 1.5


class JpegPhotos(Dataset):
    """Decodes a JPEG, random-crops and flips it (uses the RNG), returns a uint8 CHW tensor."""

    def __init__(self, jpegs: list[bytes], startup_s: float = 0.0) -> None:
        self.jpegs = jpegs
        self.startup_s = startup_s
        self._opened_in: int | None = None

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.startup_s and self._opened_in != os.getpid():
            time.sleep(self.startup_s)  # like opening a large file in each new process
            self._opened_in = os.getpid()
        image = Image.open(io.BytesIO(self.jpegs[index])).convert("RGB")
        left, top = np.random.randint(0, 33, size=2)
        image = image.crop((left, top, left + 224, top + 224))
        array = np.asarray(image)
        if np.random.rand() < 0.5:
            array = array[:, ::-1]
        return torch.from_numpy(array.copy()).permute(2, 0, 1), index % 10


def _loaders(dataset: Dataset, batch: int) -> dict[str, Any]:
    common = dict(batch_size=batch, shuffle=True, num_workers=2)
    return {
        "torch": TorchDataLoader(dataset, **common),
        "torch_persistent": TorchDataLoader(dataset, persistent_workers=True, **common),
        "fastloader": DataLoader(dataset, seed=0, **common),
    }


def _time_epochs(loader: Any, epochs: int, step_s: float) -> dict[str, list[float]]:
    """Per epoch: time to the first batch, then samples/s and mean interval of the others, and
    samples/s of the whole epoch (its first batch included)."""
    first_batch, steady, intervals, whole = [], [], [], []
    for _ in range(epochs):
        started = time.perf_counter()
        iterator = iter(loader)
        images, _ = next(iterator)
        first = time.perf_counter()
        first_batch.append(first - started)
        samples = batches = 0
        for images, _ in iterator:
            time.sleep(step_s)  # the training step
            samples += len(images)
            batches += 1
        elapsed = time.perf_counter() - first
        steady.append(samples / elapsed)
        intervals.append(elapsed / max(batches, 1))
        whole.append((samples + len(images)) / (time.perf_counter() - started))
    return {
        "first_batch_s": first_batch,
        "steady_samples_per_s": steady,
        "interval_s": intervals,
        "epoch_samples_per_s": whole,
    }


def _throughput(
    jpegs: list[bytes], batch: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Samples/s with no training step, loaders taking turns so noise hits all alike: steady
    (after each epoch's first batch) and whole epochs; two epochs per loader per turn, the
    second timed: a persistent pool loads ahead while the other loaders are timed (up to a
    whole short epoch: fastloader's cross-epoch prefetch), and the first epoch of a turn would
    time what was loaded then. What it loads ahead of the second, it loads during the first."""
    loaders = _loaders(JpegPhotos(jpegs), batch)
    names = list(loaders)
    steady: dict[str, list[float]] = {name: [] for name in names}
    whole: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        note(f"steady throughput, round {round_ + 1} of {rounds}")
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            timed = _time_epochs(loaders[name], 2, 0.0)
            steady[name].append(timed["steady_samples_per_s"][1])
            whole[name].append(timed["epoch_samples_per_s"][1])
    for loader in loaders.values():
        if hasattr(loader, "close"):
            loader.close()
    return steady, whole


def _epoch_comparison(jpegs: list[bytes], epochs: int, batch: int, step_s: float) -> dict:
    results = {}
    for name, loader in _loaders(JpegPhotos(jpegs), batch).items():
        results[name] = _time_epochs(loader, epochs, step_s)
        if hasattr(loader, "close"):
            loader.close()
    return results


def _startup_comparison(jpegs: list[bytes], batch: int, startup_s: float) -> dict:
    results = {}
    for name, loader in _loaders(JpegPhotos(jpegs, startup_s=startup_s), batch).items():
        results[name] = _time_epochs(loader, 3, 0.0)["first_batch_s"]
        if hasattr(loader, "close"):
            loader.close()
    return results


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _seeding_overhead_us(samples: int, repeats: int = 5) -> dict[str, float]:
    """Per-sample cost of seeding: loop with vs without it, and the seeding call alone."""
    dataset = _Indices(samples)
    with_seeding, without = [], []
    for _ in range(repeats):
        for loader, times in (
            (TorchDataLoader(dataset, batch_size=256), without),
            (DataLoader(dataset, batch_size=256, seed=0), with_seeding),
        ):
            started = time.perf_counter()
            for _ in loader:
                pass
            times.append((time.perf_counter() - started) / samples * 1e6)
    calls = []
    for _ in range(repeats):
        started = time.perf_counter()
        for index in range(samples // 4):
            seed_rngs(sample_seed(0, 1, index))
        calls.append((time.perf_counter() - started) / (samples // 4) * 1e6)
    return {
        "loader_overhead_us_per_sample": statistics.median(with_seeding)
        - statistics.median(without),
        "seed_call_us": statistics.median(calls),
    }


def run(size: str, workdir: Path) -> dict:
    """Run the loader comparison at ``size`` ("tiny", "quick", "full")."""
    samples, batch, rounds, epochs, startup_s, seeding_samples = SIZES[size]
    note("making the photos")
    jpegs = photo_jpegs(samples)
    rates, whole_epochs = _throughput(jpegs, batch, rounds)
    steady = {name: statistics.median(values) for name, values in rates.items()}

    def vs(name: str, base: str, measured: dict[str, list[float]] = rates) -> float:
        return paired_ratio(measured[name], measured[base])

    step_s = STEP_IN_BATCH_INTERVALS * batch / steady["fastloader"]
    note(f"first batch of {epochs} epochs, with a training step")
    epochs_result = _epoch_comparison(jpegs, epochs, batch, step_s)
    note(f"a dataset with {startup_s} s of start-up per worker")
    startup = _startup_comparison(jpegs[: batch * 4], batch, startup_s)
    note("seeding overhead")
    seeding = _seeding_overhead_us(seeding_samples)

    def later_first_batch(name: str) -> float:
        return statistics.median(epochs_result[name]["first_batch_s"][1:])

    def interval(name: str) -> float:
        return statistics.median(epochs_result[name]["interval_s"][1:])

    rows = []
    for name, result in epochs_result.items():
        rows.append(
            {
                "loader": name,
                "steady_samples_per_s": round(steady[name], 1),
                "vs_torch_steady": significant(vs(name, "torch")),
                "first_batch_ms_epoch1": round(result["first_batch_s"][0] * 1e3, 1),
                "first_batch_ms_later_median": round(later_first_batch(name) * 1e3, 2),
                "batch_interval_ms": round(interval(name) * 1e3, 1),
                "vs_torch_epoch_start": significant(
                    later_first_batch("torch") / later_first_batch(name)
                ),
                "startup_dataset_epoch2_first_batch_ms": round(startup[name][1] * 1e3, 1),
            }
        )
    return {
        "comparison": "loader",
        "config": {
            "samples": samples,
            "batch_size": batch,
            "num_workers": 2,
            "throughput_rounds": rounds,
            "epochs": epochs,
            "step_ms": round(step_s * 1e3, 1),
            "startup_s": startup_s,
        },
        "rows": rows,
        "throughput_samples_per_s": rates,
        "epoch_samples_per_s": whole_epochs,
        "epochs": epochs_result,
        "startup_first_batch_s": startup,
        "seeding": seeding,
        "ratios": {
            "steady_throughput_vs_torch": vs("fastloader", "torch"),
            "steady_throughput_vs_torch_persistent": vs("fastloader", "torch_persistent"),
            "epoch_throughput_vs_torch_persistent": vs(
                "fastloader", "torch_persistent", whole_epochs
            ),
            "epoch_start_speedup_vs_torch_persistent": later_first_batch("torch_persistent")
            / later_first_batch("fastloader"),
            "epoch_start_speedup_vs_torch": later_first_batch("torch")
            / later_first_batch("fastloader"),
            "epoch_start_in_batch_intervals": later_first_batch("fastloader")
            / interval("fastloader"),
            "startup_dataset_epoch2_speedup_vs_torch": startup["torch"][1]
            / startup["fastloader"][1],
            "seeding_us_per_sample": max(seeding["seed_call_us"], 1e-3),
        },
        "notes": [
            "2 workers, shuffle=True, batches of decoded+cropped JPEG photos",
            f"steady samples/s: no training step; median of {rounds} epochs per loader, the "
            "loaders taking turns (two epochs a turn, the second timed: a persistent pool loads "
            "ahead while the others are timed); ratios are medians of the per-round ratios "
            "(steady: after each epoch's first batch; epoch: the whole epoch)",
            f"epoch start: a {step_s * 1e3:.0f} ms training step per batch "
            f"({STEP_IN_BATCH_INTERVALS}x fastloader's batch time, so the loader keeps up); "
            "first batch of epochs 2..N, median; batch interval: the step as seen by training",
        ],
    }
