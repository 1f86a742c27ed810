"""Worker supervision: recovery time after a worker dies, and its cost in steady throughput.

- Recovery: while an epoch runs, the worker holding the next batch is SIGKILLed right after a
  batch is received; the time until the next batch arrives (detection, a replacement worker,
  the re-sent batches loaded again) is compared with the usual interval between batches.
- Cost: steady throughput (samples/s over whole epochs, after a warm-up epoch) with
  supervision on and off (``WorkerPoolIter.supervise``), in interleaved rounds; the ratio of
  medians is reported (goal: no more than 2% lower with supervision).

Run alone: ``python -m benchmarks --only supervision``.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import Dataset

from benchmarks._stats import significant
from fastloader import DataLoader
from fastloader.loader.iterators import WorkerPoolIter
from fastloader.loader.supervision import POLL_S

SIZES = {
    #        samples, batch, throughput rounds, epochs per round, kills, load seconds/sample
    "tiny": (256, 16, 1, 1, 2, 0.001),
    "quick": (2048, 32, 7, 2, 6, 0.001),
    "full": (4096, 32, 11, 3, 12, 0.001),
}


class Vectors(Dataset):
    """A small tensor per sample, with a fixed loading time (like a fast decode)."""

    def __init__(self, n: int, load_s: float) -> None:
        self.n, self.load_s = n, load_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.load_s:
            deadline = time.perf_counter() + self.load_s
            while time.perf_counter() < deadline:
                pass
        return torch.full((64,), float(index))


def _loader(samples: int, batch: int, load_s: float) -> DataLoader:
    return DataLoader(
        Vectors(samples, load_s), batch_size=batch, shuffle=True, num_workers=2, seed=0
    )


def recovery(samples: int, batch: int, load_s: float, kills: int) -> dict:
    """Median time from a worker's SIGKILL to the batch it was loading, and the usual interval.

    The worker is killed while it loads the next batch due (it has started it, so its result
    cannot already be on its way), which makes the measured time detection + a replacement
    worker + loading the batch again.
    """
    loader = _loader(samples, batch, load_s)
    list(loader)  # warm up: workers started, first epoch done
    intervals, recoveries = [], []
    batches_per_epoch = len(loader)
    gap = max(3, batches_per_epoch // (kills + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(recoveries) < kills:
            iterator = iter(loader)
            last = time.perf_counter()
            for step, _ in enumerate(iterator):
                now = time.perf_counter()
                if step % gap != 0:
                    intervals.append(now - last)
                last = now
                if step % gap or step + 2 >= batches_per_epoch or len(recoveries) >= kills:
                    continue
                due = iterator._rcvd_idx
                holder = iterator._task_info[due][0]
                while iterator._progress[holder] < due:  # wait until it is loading `due`
                    time.sleep(0.0002)
                killed = time.perf_counter()
                os.kill(iterator._workers[holder].pid, signal.SIGKILL)
                next(iterator)
                recoveries.append(time.perf_counter() - killed)
                last = time.perf_counter()
    loader.close()
    return {
        "recovery_ms": 1000 * statistics.median(recoveries),
        "recovery_max_ms": 1000 * max(recoveries),
        "batch_interval_ms": 1000 * statistics.median(intervals),
        "kills": len(recoveries),
    }


def throughput(samples: int, batch: int, load_s: float, rounds: int, epochs: int) -> dict:
    """Samples/s with supervision on and off: two warm loaders, epochs taken in turns.

    Both loaders live through the whole run and alternate epoch by epoch (on/off, then
    off/on), so slow spells of a shared machine hit both; reports the medians and the median
    of the per-round ratios.
    """
    loaders = {}
    try:
        for mode in ("on", "off"):
            WorkerPoolIter.supervise = mode == "on"
            loaders[mode] = _loader(samples, batch, load_s)
            list(loaders[mode])  # warm-up epoch: workers started
    finally:
        WorkerPoolIter.supervise = True
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for round_index in range(rounds * epochs):
        order = ("on", "off") if round_index % 2 == 0 else ("off", "on")
        for mode in order:
            started = time.perf_counter()
            count = sum(len(values) for values in loaders[mode])
            rates[mode].append(count / (time.perf_counter() - started))
    for loader in loaders.values():
        loader.close()
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    paired = statistics.median(a / b for a, b in zip(rates["on"], rates["off"], strict=True))
    return {"on": on, "off": off, "ratio": on / off, "paired": paired, "rounds": rounds * epochs}


def run(size: str, workdir: Path) -> dict:
    """Run the supervision comparison at ``size`` ("tiny", "quick", "full")."""
    samples, batch, rounds, epochs, kills, load_s = SIZES[size]
    healed = recovery(samples, batch, load_s, kills)
    steady = throughput(samples, batch, load_s, rounds, epochs)
    return {
        "comparison": "supervision",
        "config": {
            "samples": samples,
            "batch_size": batch,
            "num_workers": 2,
            "load_ms_per_sample": 1000 * load_s,
            "rounds": rounds,
            "epochs_per_round": epochs,
        },
        "rows": [
            {
                "measure": "worker SIGKILL -> the batch it was loading (median ms)",
                "value": round(healed["recovery_ms"], 1),
            },
            {
                "measure": "... slowest of the kills (ms)",
                "value": round(healed["recovery_max_ms"], 1),
            },
            {
                "measure": "usual batch interval (median ms)",
                "value": round(healed["batch_interval_ms"], 2),
            },
            {"measure": "samples/s, supervision on (median)", "value": round(steady["on"])},
            {"measure": "samples/s, supervision off (median)", "value": round(steady["off"])},
        ],
        "ratios": {
            "supervised_over_unsupervised_throughput": significant(steady["ratio"]),
            "supervised_over_unsupervised_paired_median": significant(steady["paired"]),
        },
        "notes": [
            f"{healed['kills']} kills of the worker loading the next batch due; recovery = "
            f"detection (polls every {POLL_S * 1000:.0f} ms) + a new worker + the batch again",
            f"throughput: {steady['rounds']} epochs of each loader, taken in turns after a "
            "warm-up epoch; ratio of medians and median of per-turn ratios (goal >= 0.98)",
        ],
    }
