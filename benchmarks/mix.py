"""What mixing costs: ``fastloader.Mix`` vs reading the same sources concatenated.

Three sources (sizes 4:2:1) are read by ``fastloader.DataLoader`` with 2 workers, either as a
``ConcatDataset`` with ``shuffle=True`` (the baseline: the same samples, one shuffled order) or
as a ``Mix`` weighted by size, yielding ``MixSample``s (``mix``: the source's name and index
collated too) or the bare samples (``mix_bare``: the order's cost alone). The loaders take
turns epoch by epoch; each ratio is the median of per-round ratios of samples/s:

- ``index``: ``dataset[i]`` returns ``i`` (batch 256): mixing's cost per sample, exposed;
- ``tokens``: 2048-token windows from a uint16 memmap (batch 16), as in LLM pre-training.

Wall time on a loaded 2-core machine swings by tens of percent between rounds, so the same
comparison is also made in CPU time (``time.process_time``) of one process loading everything
(``num_workers=0``): what mixing adds to the work, whoever does it.

The order alone (no loader): microseconds per sample to map positions to samples (the
samplers do it in the main process, 8192 at a time), ``draws_before`` at position 5e7 (a
resume there), ``state_dict`` of a loader over 16 sources (time and JSON size), and the order's
memory for 16 sources of 10**8 samples in all.

Run alone: ``python -m benchmarks --only mix``.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, Dataset

from benchmarks._progress import note
from benchmarks._stats import paired_ratio, rotated
from benchmarks.cheap import IndexDataset, TokenWindows, _interleaved, _token_file
from fastloader import DataLoader, Mix
from fastloader.sampling.mix_order import MixOrder

SIZES = {
    #        rounds, index samples (largest source), token windows (largest source)
    "tiny": (2, 2048, 64),
    "quick": (5, 65_536, 1024),
    "full": (11, 131_072, 4096),
}
PARTS = {"a": 4, "b": 2, "c": 1}  # relative source sizes
WORKERS = 2


def _sources(make: Any, largest: int) -> dict[str, Dataset]:
    return {name: make(largest * part // 4) for name, part in PARTS.items()}


def _loaders(sources: dict[str, Dataset], batch: int) -> dict[str, Any]:
    common = dict(batch_size=batch, num_workers=WORKERS, seed=0)
    sizes = {name: float(len(ds)) for name, ds in sources.items()}
    return {
        "concat": DataLoader(ConcatDataset(list(sources.values())), shuffle=True, **common),
        "mix": DataLoader(Mix(sources, sizes), **common),
        "mix_bare": DataLoader(Mix(sources, sizes, with_source=False), **common),
    }


def _compare(name: str, sources: dict[str, Dataset], batch: int, rounds: int) -> dict:
    note(f"{name}, {WORKERS} workers")
    loaders = _loaders(sources, batch)
    try:
        seconds = _interleaved(loaders, rounds)
    finally:
        for loader in loaders.values():
            loader.close()
    samples = sum(len(ds) for ds in sources.values())
    row: dict[str, Any] = {"dataset": name, "num_workers": WORKERS, "batch_size": batch}
    for loader_name, times in seconds.items():
        row[f"{loader_name}_samples_per_s"] = round(samples / statistics.median(times), 1)
    for loader_name in ("mix", "mix_bare"):
        row[f"vs_concat_{loader_name}"] = round(
            paired_ratio(seconds["concat"], seconds[loader_name]), 4
        )
    return row


def _cpu_rows(name: str, sources: dict[str, Dataset], batch: int, rounds: int) -> dict:
    """CPU seconds per epoch with ``num_workers=0`` (``time.process_time``): all the loading
    work in one process, less sensitive than wall time to a loaded machine."""
    note(f"{name}, CPU time, 0 workers")
    common = dict(batch_size=batch, num_workers=0, seed=0)
    sizes = {key: float(len(ds)) for key, ds in sources.items()}
    loaders = {
        "concat": DataLoader(ConcatDataset(list(sources.values())), shuffle=True, **common),
        "mix": DataLoader(Mix(sources, sizes), **common),
        "mix_bare": DataLoader(Mix(sources, sizes, with_source=False), **common),
    }
    seconds: dict[str, list[float]] = {key: [] for key in loaders}
    for loader in loaders.values():
        _cpu_epoch(loader)  # warm-up
    names = list(loaders)
    for round_ in range(rounds):
        for key in rotated(names, round_):
            seconds[key].append(_cpu_epoch(loaders[key]))
    samples = sum(len(ds) for ds in sources.values())
    row: dict[str, Any] = {"dataset": name, "num_workers": 0, "batch_size": batch}
    for key, times in seconds.items():
        row[f"{key}_cpu_us_per_sample"] = round(statistics.median(times) / samples * 1e6, 3)
    for key in ("mix", "mix_bare"):
        row[f"vs_concat_{key}"] = round(paired_ratio(seconds["concat"], seconds[key]), 4)
    return row


def _cpu_epoch(loader: Any) -> float:
    started = time.process_time()
    for _ in loader:
        pass
    return time.process_time() - started


def _order_costs() -> dict[str, Any]:
    """The order alone: mapping, a far resume, the state, memory (no loader running)."""
    sizes = {f"s{i:02d}": int(n) for i, n in enumerate(np.geomspace(1e3, 1e6, 16))}
    weights = {name: 1.0 + i for i, name in enumerate(sizes)}
    order = MixOrder(sizes, [(0, weights), (10**6, dict.fromkeys(sizes, 1.0))], seed=0)
    positions = np.arange(5 * 10**6, 5 * 10**6 + 8192 * 8)
    started = time.perf_counter()
    for at in range(0, len(positions), 8192):
        order.indices(positions[at : at + 8192])
    per_sample_us = (time.perf_counter() - started) / len(positions) * 1e6
    started = time.perf_counter()
    for _ in range(100):
        order.draws_before(5 * 10**7)
    far_resume_us = (time.perf_counter() - started) / 100 * 1e6

    mix = Mix({name: IndexDataset(n) for name, n in sizes.items()}, weights)
    loader = DataLoader(mix, batch_size=64, seed=0)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    timings = []
    for _ in range(200):
        started = time.perf_counter()
        state = loader.state_dict()
        timings.append(time.perf_counter() - started)
    state_bytes = len(json.dumps(state))

    big = {f"s{i:02d}": 6_250_000 for i in range(16)}  # 10**8 samples
    tracemalloc.start()
    big_order = MixOrder(big, [(0, dict.fromkeys(big, 1.0))], seed=0)
    big_order.indices(np.arange(5 * 10**7, 5 * 10**7 + 8192))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "map_us_per_sample": round(per_sample_us, 3),
        "draws_before_5e7_us": round(far_resume_us, 1),
        "state_dict_ms_median": round(statistics.median(timings) * 1e3, 4),
        "state_dict_json_bytes": state_bytes,
        "order_1e8_samples_peak_mb": round(peak / 2**20, 2),
        "order_1e8_pickled_bytes": len(pickle.dumps(big_order)),
    }


def run(size: str, workdir: Path) -> dict:
    """Run the mixing comparison at ``size`` ("tiny", "quick", "full")."""
    rounds, index_largest, windows = SIZES[size]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [_compare("index", _sources(IndexDataset, index_largest), 256, rounds)]
    path = _token_file(workdir, windows * 7 // 4)
    token_sources = {
        name: _Slice(TokenWindows(path, windows * 7 // 4), offset, windows * part // 4)
        for name, part, offset in _offsets(windows)
    }
    rows.append(_compare("tokens", token_sources, 16, rounds))
    cpu_rows = [
        _cpu_rows("index", _sources(IndexDataset, index_largest), 256, rounds),
        _cpu_rows("tokens", token_sources, 16, rounds),
    ]
    note("the order alone")
    order = _order_costs()
    ratios = {
        f"{row['dataset']}_{name}_vs_concat": row[f"vs_concat_{name}"]
        for row in rows
        for name in ("mix", "mix_bare")
    }
    return {
        "comparison": "mix",
        "config": {"rounds": rounds, "workers": WORKERS, "parts": PARTS},
        "rows": rows,
        "cpu_rows": cpu_rows,
        "order_rows": [order],
        "ratios": ratios,
        "notes": [
            "vs_concat_*: the mix's samples/s over the concatenation's (shuffle=True), median "
            f"of per-round ratios ({rounds} interleaved rounds after a warm-up epoch); 1.00x is "
            "no cost",
            f"load average at the start: {load:.2f} (a shared machine: ratios, not times)",
            "cpu: CPU seconds of the one process that loads (num_workers=0), per sample; "
            "vs_concat_* = the concatenation's CPU time over the mix's (1.00x: no cost)",
            "order: mapping cost per sample in the main process, a resume at 5e7, state_dict "
            "of a loader over 16 sources, memory for 16 sources of 1e8 samples",
        ],
    }


def _offsets(windows: int) -> list[tuple[str, int, int]]:
    out, offset = [], 0
    for name, part in PARTS.items():
        out.append((name, part, offset))
        offset += windows * part // 4
    return out


class _Slice(Dataset):
    """Windows ``[offset, offset + length)`` of a token file: one source."""

    def __init__(self, windows: TokenWindows, offset: int, length: int) -> None:
        self.windows, self.offset, self.length = windows, offset, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.windows[self.offset + index]
