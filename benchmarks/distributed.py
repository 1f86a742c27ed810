"""The cost of the global order (distributed=True) vs torch's DistributedSampler, state size.

``distributed=True`` draws each epoch's order of the *whole* dataset from ``(seed, epoch)``
(``fastloader.distributed.ElasticDistributedSampler``) and each rank takes its slice of every
global batch; torch's ``DistributedSampler`` permutes the whole dataset too, then builds a
Python list of it. Per round (interleaved, a new epoch each time) and sampler, for one rank of
8: the time until the epoch's first index (the permutation: what every epoch pays before its
first batch) and the time to list all of the rank's indices. The ratio is torch's median over
fastloader's (> 1: fastloader faster). The state size is the length of a mid-epoch
``json.dumps(loader.state_dict())`` for a small and a large dataset: it must not grow with it.

Run alone: ``python -m benchmarks --only distributed``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import DistributedSampler

from fastloader import DataLoader
from fastloader.sampling.distributed import ElasticDistributedSampler

SIZES = {
    #        samples, rounds
    "tiny": (100_000, 3),
    "quick": (10_000_000, 5),
    "full": (10_000_000, 9),
}
WORLD_SIZE, RANK, BATCH = 8, 3, 256


def _samplers(n: int) -> dict[str, Any]:
    dataset = range(n)
    return {
        "fastloader global order": ElasticDistributedSampler(
            dataset, BATCH, num_replicas=WORLD_SIZE, rank=RANK, seed=0
        ),
        "torch DistributedSampler": DistributedSampler(
            dataset, num_replicas=WORLD_SIZE, rank=RANK, seed=0
        ),
    }


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _order_times(n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    samplers = _samplers(n)
    times = {name: {"first_index_s": [], "rank_list_s": []} for name in samplers}
    for epoch in range(rounds):
        for name, sampler in samplers.items():  # interleaved: both see the same machine load
            sampler.set_epoch(epoch)
            times[name]["first_index_s"].append(_timed(lambda s=sampler: next(iter(s))))
            times[name]["rank_list_s"].append(_timed(lambda s=sampler: list(s)))
    return times


def _state_bytes(n: int) -> int:
    sampler = ElasticDistributedSampler(range(n), BATCH, num_replicas=WORLD_SIZE, rank=RANK)
    loader = DataLoader(range(n), batch_size=BATCH, sampler=sampler)
    iterator = iter(loader)
    next(iterator)
    return len(json.dumps(loader.state_dict()))


def run(size: str, workdir: Path) -> dict:
    """Run the comparison at ``size`` ("tiny", "quick", "full"); ``workdir`` is not used."""
    n, rounds = SIZES[size]
    times = _order_times(n, rounds)
    medians = {
        name: {key: statistics.median(values) for key, values in by_key.items()}
        for name, by_key in times.items()
    }
    torch_name = "torch DistributedSampler"
    rows = [
        {
            "sampler": name,
            "samples": n,
            "first_index_s": round(result["first_index_s"], 4),
            "rank_list_s": round(result["rank_list_s"], 4),
            "vs_torch_first_index": round(
                medians[torch_name]["first_index_s"] / result["first_index_s"], 3
            ),
        }
        for name, result in medians.items()
    ]
    state_rows = [
        {"dataset_samples": size, "state_bytes": _state_bytes(size)} for size in (1000, n)
    ]
    ours = medians["fastloader global order"]
    return {
        "comparison": "distributed",
        "config": {"samples": n, "rounds": rounds, "world_size": WORLD_SIZE, "batch_size": BATCH},
        "rows": rows,
        "state_rows": state_rows,
        "ratios": {
            "global_order_first_index_speedup_vs_torch": round(
                medians[torch_name]["first_index_s"] / ours["first_index_s"], 3
            ),
            "global_order_rank_list_speedup_vs_torch": round(
                medians[torch_name]["rank_list_s"] / ours["rank_list_s"], 3
            ),
            "state_bytes_large_over_small": round(
                state_rows[1]["state_bytes"] / state_rows[0]["state_bytes"], 3
            ),
        },
        "notes": [
            f"one rank of {WORLD_SIZE}, batch_size {BATCH}; medians of {rounds} interleaved "
            "rounds, a new epoch each round",
            "first_index_s: until the epoch's first index (the whole permutation); "
            "rank_list_s: all of this rank's indices as Python ints",
            "state_bytes: json.dumps(loader.state_dict()) in the middle of an epoch",
        ],
    }
