"""The ``remote`` peer table (issue 37): epochs from S3 of fastloader, litdata and MDS.

The same samples (the ``remote`` benchmark's 64x64x3 images and labels, written once to an HDF5
file every peer builds from) go to one SeaweedFS server on loopback: fastloader's sharded pack
(shards of 4 MB), litdata's ``optimize()`` chunks (4 MB) and MDS shards (4 MB). Every loader
gets the cache limit fastloader's ``ShardedDataset`` takes by default. Per round and source a
fresh cache and one loader (2 workers, batch 64, persistent workers): its first epoch (cold)
and its second (warm); the sources in alternating order. One untimed cold epoch per source
before the rounds checks its samples against the file (``samples_match``).
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np

from benchmarks import peer_litdata, peer_mds
from benchmarks._stats import paired_ratio
from benchmarks.peer_rows import PEERS, OurLoader, _failed, build_peers, unavailable
from benchmarks.peer_samples import file_digest

BUCKET, SHARD, BATCH, WORKERS = "bench-peers", "4MB", 64, 2
OURS = "fastloader ShardedDataset"


def write_source(dataset: Any, path: Path) -> Path:
    """The dataset's samples (``image`` and ``label``) as an HDF5 file, the peers' source."""
    import h5py

    if path.exists():
        return path
    first = dataset[0]
    with h5py.File(path, "w") as file:
        image = file.create_dataset("image", (len(dataset), *first["image"].shape), np.uint8)
        label = file.create_dataset("label", (len(dataset),), np.int64)
        for index in range(len(dataset)):
            sample = dataset[index]
            image[index] = sample["image"]
            label[index] = sample["label"]
    return path


def _upload(built: dict[str, Any], dataset: Any) -> dict[str, Any]:
    """Every source on the server: key -> URL (or the reason there is none)."""
    import boto3

    from fastloader import pack

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    urls: dict[str, Any] = {"ours": f"s3://{BUCKET}/ours"}
    pack(dataset, urls["ours"], shard_size=SHARD, workers=0, progress=False)
    for key, where in built.items():
        urls[key] = peer_mds.upload(where, BUCKET, key) if isinstance(where, Path) else where
    return urls


def _factories(urls: dict, limit: int, endpoint: str, fields: tuple) -> dict[str, Callable]:
    """Source name -> a function of a cache folder that makes its loader."""
    from fastloader import ShardedDataset

    factories: dict[str, Callable[[Path], Any]] = {
        OURS: lambda cache: OurLoader(
            ShardedDataset(urls["ours"], cache_dir=cache), BATCH, WORKERS, fields
        )
    }
    common = {"batch": BATCH, "workers": WORKERS, "fields": fields, "cache_limit": limit}
    for key, (name, peer, _) in PEERS.items():
        url = urls[key]
        if not str(url).startswith("s3://"):
            factories[name] = unavailable(url)
            continue
        config = {**common, "remote": url, "endpoint": endpoint}
        factories[name] = lambda cache, p=peer, c=config: p({**c, "local": str(cache)})
    return factories


def _cold_warm(factory: Callable[[Path], Any], cache: Path, digest: bool = False) -> Any:
    """One loader on an empty cache: (cold rate, warm rate), or its (samples, checksum)."""
    shutil.rmtree(cache, ignore_errors=True)
    loader = factory(cache)
    try:
        if digest:
            return loader.digest()
        rates = []
        for _ in range(2):
            samples, seconds = loader.epoch()
            rates.append(samples / seconds)
        return rates
    finally:
        loader.close()
        shutil.rmtree(cache, ignore_errors=True)


def _measure(factories: dict, rounds: int, workdir: Path, expected: tuple) -> tuple[dict, dict]:
    matches, reasons = {}, {}
    for name, factory in factories.items():
        try:
            matches[name] = _cold_warm(factory, workdir / "peer-cache", digest=True) == expected
        except Exception as error:  # noqa: BLE001 - the row says why
            reasons[name] = _failed(error)
    names = [name for name in factories if name not in reasons]
    rates: dict[str, list[list[float]]] = {name: [] for name in names}
    for number in range(rounds):
        for name in names if number % 2 == 0 else reversed(names):
            rates[name].append(_cold_warm(factories[name], workdir / "peer-cache"))
    return {"matches": matches, "reasons": reasons}, rates


def _rows(factories: dict, checks: dict, rates: dict) -> tuple[list[dict], dict]:
    rows, ratios = [], {}
    for name in factories:
        if name in checks["reasons"]:
            rows.append({"source": name, "note": checks["reasons"][name]})
            continue
        cold = [r[0] for r in rates[name]]
        warm = [r[1] for r in rates[name]]
        row = {
            "source": name,
            "cold_epoch_per_s": round(statistics.median(cold)),
            "warm_epoch_per_s": round(statistics.median(warm)),
            "samples_match": checks["matches"][name],
        }
        rows.append(row)
    ours = rows[0]
    for key, (name, _, _) in PEERS.items():
        if name not in rates or OURS not in rates:
            continue
        for epoch, index in (("cold", 0), ("warm", 1)):
            mine = [r[index] for r in rates[OURS]]
            theirs = [r[index] for r in rates[name]]
            ratio = round(paired_ratio(mine, theirs), 2)
            ours[f"vs_{key}_{epoch}"] = ratio
            ratios[f"s3 {epoch} epoch ours over {key}"] = ratio
    return rows, ratios


def remote(dataset: Any, rounds: int, workdir: Path) -> dict:
    """The peer table over S3: rows, ratios and notes (see the module docstring)."""
    try:
        from tests import _seaweed
    except ImportError:
        _seaweed = None
    if _seaweed is None or shutil.which("weed") is None:
        return {"rows": [], "ratios": {}, "notes": ["peers over S3 skipped: weed not installed"]}
    workdir = Path(workdir) / "peers"
    workdir.mkdir(parents=True, exist_ok=True)
    source = write_source(dataset, workdir / f"remote-samples-{len(dataset)}.h5")
    expected = file_digest(source)
    built = build_peers(source, workdir, len(dataset), SHARD)
    server = _seaweed.start(workdir / "seaweed")
    try:
        with patch.dict(os.environ, {**server.env(), "S3_ENDPOINT_URL": server.endpoint}):
            urls = _upload(built, dataset)
            from fastloader import ShardedDataset

            limit = ShardedDataset(urls["ours"], cache_dir=workdir / "probe").cache.limit
            fields = ("image", "label")
            factories = _factories(urls, limit, server.endpoint, fields)
            checks, rates = _measure(factories, rounds, workdir, expected)
    finally:
        _seaweed.stop(server)
    rows, ratios = _rows(factories, checks, rates)
    notes = [
        f"peers over S3: {len(dataset)} samples (64x64x3 uint8, a label), SeaweedFS on "
        f"loopback, shards/chunks of {SHARD}, cache limit {limit / 2**20:.0f} MiB for every "
        f"source, {WORKERS} workers, batch {BATCH}, {rounds} rounds of (fresh cache: cold "
        "epoch, warm epoch), sources in alternating order; litdata "
        f"{'with obstore' if _has_obstore() else 'over boto3 (obstore not installed)'}; "
        "samples_match: an untimed cold epoch's order-free checksum equals the samples'"
    ]
    return {"rows": rows, "ratios": ratios, "notes": notes}


def _has_obstore() -> bool:
    import importlib.util

    return peer_litdata.available() and importlib.util.find_spec("obstore") is not None
