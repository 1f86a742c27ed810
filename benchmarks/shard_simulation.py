"""What the shard-aware order costs a cluster, simulated without data: per-node downloads, the
cache each node needs at its peak, and GET/s against S3's 5 500 GET/s per prefix.

The order of one epoch (``shard_epoch_order``) over ``S`` shards of ``per_shard`` samples,
dealt to ``nodes x ranks_per_node`` ranks of ``batch`` samples per step as ``ShardOrderSampler``
deals it (each step's positions sorted by lane, cut into ranks; NOTE [ The shard-aware order ]).
A node downloads a shard once, when one of its ranks first reads it, and (an ideal cache) needs
it until its ranks last read it in the epoch:

- ``downloads_per_node``: shards a node fetches per epoch (mean, max), and bytes fetched over
  the node's share of the dataset (``S / nodes`` shards): the goal is <= 1.05x once the cache
  holds the working set;
- ``working_set_peak``: the most shards a node's ranks are between their first and last read
  of at one step (max over nodes), counting a shard cut by a lane's end once per lane (its two
  pieces are read at the epoch's start and end: a cache at the minimum evicts it in between
  and fetches it once more, which ``bytes_vs_share_at_minimum`` counts); ``cache_peak`` adds
  the ``ahead`` shards per rank the download-ahead fetches; ``cache_minimum`` is what
  ``ShardedDataset`` asks of ``cache_limit`` (``shards.cache.cache_minimum``): it must be >=
  the peak, or shards are evicted while read;
- ``get_per_s``: one GET per download (``ShardCache``), spread over an epoch of ``epoch_s``
  seconds: the mean, and the busiest step's (the epoch's first step, when every node fetches
  its first windows at once, and the busiest later one).

Run: ``python -m benchmarks.shard_simulation`` (``--shards``, ``--epoch-s``, ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any
from unittest.mock import patch

import numpy as np

from fastloader.sampling.shard_order import shard_epoch_order
from fastloader.shards.cache import cache_minimum

S3_GET_PER_S = 5_500  # S3's documented GET/HEAD rate per prefix
NODES, RANKS_PER_NODE, BATCH, PER_SHARD, AHEAD = 64, 8, 8, 100, 2
SHARD_BYTES = 64_000_000
SHAPES = ((512, 4), (64, 4), (8, 4))  # (lanes, window): a multiple of the nodes, the nodes, fewer


def _dealt(order: np.ndarray, lanes: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The order as steps (rows) of ``global_batch`` positions, each sorted by lane as the
    sampler deals it (column ``c`` of a row goes to rank ``c // batch``), and their lanes."""
    steps = order[: len(order) // global_batch * global_batch].reshape(-1, global_batch)
    lane = (np.arange(steps.size) % lanes).reshape(steps.shape)
    by_lane = np.argsort(lane, axis=1, kind="stable")
    return np.take_along_axis(steps, by_lane, axis=1), np.take_along_axis(lane, by_lane, axis=1)


def _spans(keys: np.ndarray, count: int) -> tuple[np.ndarray, ...]:
    """For each distinct key of ``keys`` (steps as rows): the key, its first and last step."""
    steps = np.repeat(np.arange(count, dtype=np.int64), keys.shape[1])
    both = np.unique(keys.ravel() * count + steps)  # sorted by key, then step
    key, step = both // count, both % count
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[starts[1:], len(key)] - 1
    return key[starts], step[starts], step[ends]


def _world(nodes: int, ranks_per_node: int) -> Any:
    """``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` as torchrun sets them, for ``cache_minimum``."""
    world = {"WORLD_SIZE": str(nodes * ranks_per_node), "LOCAL_WORLD_SIZE": str(ranks_per_node)}
    return patch.dict(os.environ, world)


def simulate(shards: int, lanes: int, window: int, epoch_s: float) -> dict:
    """One row: the order of one epoch over ``shards`` shards for 64 nodes x 8 ranks."""
    order = shard_epoch_order(0, 0, [PER_SHARD] * shards, lanes, window)
    global_batch = NODES * RANKS_PER_NODE * BATCH
    dealt, lane = _dealt(order, lanes, global_batch)
    del order
    count = dealt.shape[0]
    node = np.arange(global_batch, dtype=np.int64) // (BATCH * RANKS_PER_NODE)
    # a piece: the part of a shard one lane holds (a shard cut by a lane's end is in two)
    pieces = ((node[None, :] * shards + dealt // PER_SHARD) * lanes + lane).astype(np.int64)
    del dealt, lane
    piece, first, last = _spans(pieces, count)
    del pieces
    pair = piece // lanes  # node * shards + shard
    new_pair = np.r_[True, pair[1:] != pair[:-1]]
    owner = pair // shards
    per_node = np.bincount(owner[new_pair], minlength=NODES)  # one download per node and shard
    per_node_pieces = np.bincount(owner, minlength=NODES)  # if evicted between two lanes
    live = np.zeros((NODES, count + 1), dtype=np.int64)  # pieces between first and last read
    np.add.at(live, (owner, first), 1)
    np.add.at(live, (owner, last + 1), -1)
    working = int(np.cumsum(live, axis=1).max())
    first = np.minimum.reduceat(first, np.flatnonzero(new_pair))  # a pair's first read
    gets = np.bincount(first, minlength=count)  # one GET per download, at its first read
    step_s = epoch_s / count
    with _world(NODES, RANKS_PER_NODE):
        minimum = cache_minimum(1, shards, lanes, window, AHEAD)  # in shards
    share = shards / NODES
    return {
        "lanes": lanes,
        "window": window,
        "shards": shards,
        "downloads_per_node_mean": round(float(per_node.mean()), 1),
        "downloads_per_node_max": int(per_node.max()),
        "bytes_vs_share": round(float(per_node.mean()) / share, 3),
        "bytes_vs_share_at_minimum": round(float(per_node_pieces.mean()) / share, 3),
        "working_set_peak": working,
        "cache_peak": working + AHEAD * RANKS_PER_NODE,
        "cache_peak_gb": round((working + AHEAD * RANKS_PER_NODE) * SHARD_BYTES / 1e9, 1),
        "cache_minimum": minimum,
        "get_per_s_mean": round(float(gets.sum()) / epoch_s, 1),
        "get_per_s_first_step": round(float(gets[0]) / step_s),
        "get_per_s_peak_later": round(float(gets[1:].max()) / step_s, 1) if count > 1 else 0.0,
    }


def rows(shards: int = 100_000, epoch_s: float = 3600.0) -> list[dict]:
    """The table: one row per (lanes, window) in ``SHAPES``."""
    return [simulate(shards, lanes, window, epoch_s) for lanes, window in SHAPES]


def _markdown(table: list[dict]) -> str:
    head = list(table[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    lines += ["| " + " | ".join(str(row[name]) for name in head) + " |" for row in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--epoch-s", type=float, default=3600.0, help="one epoch's seconds")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    table = rows(args.shards, args.epoch_s)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(_markdown(table))
        print(
            f"\n{NODES} nodes x {RANKS_PER_NODE} ranks, batch {BATCH} per rank, {args.shards} "
            f"shards of {PER_SHARD} samples ({SHARD_BYTES / 1e6:.0f} MB), ahead={AHEAD}, one "
            f"epoch in {args.epoch_s:.0f} s; S3 allows {S3_GET_PER_S} GET/s per prefix; "
            f"simulated in {time.perf_counter() - started:.1f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
