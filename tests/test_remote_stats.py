"""`loader.stats` of a sharded pack: each epoch's downloads, bytes, requests, waits and hit rate
(counted by the cache, per epoch, over a rank's processes) against a real S3-compatible server
(the `s3` fixture, tests/conftest.py), nothing new for a folder of shards, and advice that names
only the option that would change the wait (NOTE [ Download stats ] in stats/downloads.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastloader import DataLoader, Mix, ShardedDataset, ShardOrderSampler, pack
from fastloader.formats.metadata import human_size
from fastloader.stats.downloads import (
    DOWNLOAD_WAIT_SHARE,
    LOW_HIT_RATE,
    SMALL_SHARD_BYTES,
    DownloadStats,
)
from fastloader.stats.epoch import EpochStats
from tests._fields import Indexed
from tests.conftest import S3_BUCKET

SEED = 5
MB = 1 << 20
SHARD_SIZE = "32KB"  # 6 shards of 240 samples


@pytest.fixture(scope="module")
def url(s3):
    target = f"s3://{S3_BUCKET}/stats"
    pack(Indexed(240, side=6), target, shard_size=SHARD_SIZE, workers=0)
    return target


def _loader(dataset, workers=0, batch=20):
    sampler = ShardOrderSampler(dataset, batch, 1, 0, seed=SEED)
    return DataLoader(dataset, batch_size=batch, num_workers=workers, sampler=sampler, seed=SEED)


def _epoch(loader) -> list[int]:
    return [int(y) for batch in loader for y in batch["y"]]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_each_epoch_counts_its_downloads_bytes_requests_and_hits(url, tmp_path, workers):
    dataset = ShardedDataset(url, cache_dir=tmp_path, cache_limit="64MB")  # holds every shard
    shards, size = len(dataset.manifest.shards), dataset.manifest.size_bytes
    loader = _loader(dataset, workers)
    assert sorted(_epoch(loader)) == list(range(240))
    first = loader.stats.last.downloads
    # every shard once, by the download-ahead thread or a worker: one GET each
    assert (first.downloads, first.bytes_downloaded, first.requests) == (shards, size, shards)
    assert first.evictions == 0 and first.hits + first.misses > 0
    assert _epoch(loader) and loader.stats.last.epoch == 1
    second = loader.stats.last.downloads  # the cache holds them all: nothing fetched again
    assert (second.downloads, second.bytes_downloaded, second.requests) == (0, 0, 0)
    assert second.misses == 0 and second.wait_s == 0 and second.hit_rate == 1.0
    line = loader.stats.summary()
    assert "downloads 0 shards 0 B in 0 requests" in line and "hit rate 100%" in line
    reported = json.loads(json.dumps(loader.stats.as_dict()))["epochs"][0]["downloads"]
    assert reported["downloads"] == shards and reported["bytes_downloaded"] == size
    node = dataset.cache_stats()  # the node's cumulative counters agree with the epochs'
    assert node.downloads == shards and node.requests == shards
    loader.close()


@pytest.mark.slow
def test_counters_left_by_an_earlier_process_with_the_same_pid_are_not_this_ones(url, tmp_path):
    # a container restarted in place gives its processes the same host name and pids: the
    # counters an earlier run's training process left must not be taken for this one's
    import os
    import socket

    from fastloader.shards.cache_counters import process_key

    dataset = ShardedDataset(url, cache_dir=tmp_path, cache_limit="64MB")
    shards = len(dataset.manifest.shards)
    stats = dataset.cache.folder / ".stats"
    stats.mkdir(exist_ok=True)
    earlier = {"hits": 1, "misses": 1, "downloads": 2, "bytes_downloaded": 10, "requests": 2}
    start = int(process_key().rsplit("-", 1)[1])  # this process's start time
    host, pid = socket.gethostname(), os.getpid()
    for name in (f"{host}-{pid}", f"{host}-{pid}-0", f"{host}-{pid}-{start - 1}"):
        (stats / f"{name}.json").write_text(json.dumps(earlier))  # earlier processes' names
    loader = _loader(dataset, 0)
    assert sorted(_epoch(loader)) == list(range(240))
    first = loader.stats.last.downloads
    assert (first.downloads, first.requests) == (shards, shards)
    assert first.bytes_downloaded == dataset.manifest.size_bytes
    loader.close()


@pytest.mark.slow
def test_bodies_cut_off_count_as_requests_and_a_slow_server_as_waiting(url, s3, tmp_path):
    from benchmarks._fault_proxy import FaultProxy

    proxy = FaultProxy(s3.endpoint)
    try:
        dataset = ShardedDataset(
            url, cache_dir=tmp_path, cache_limit="64MB", endpoint_url=proxy.endpoint, ahead=0
        )
        shards = len(dataset.manifest.shards)
        proxy.add("cut", count=2, match="shard-", argument=3000)
        proxy.add("stall", count=shards, match="shard-", argument=0.2)
        loader = _loader(dataset)
        assert sorted(_epoch(loader)) == list(range(240))
    finally:
        proxy.close()
    epoch = loader.stats.last
    downloads = epoch.downloads
    assert downloads.downloads == shards and downloads.requests == shards + 2  # 2 resumed
    # ahead=0: the reader fetched the shards itself, through a server 0.2 s slow per GET
    assert downloads.misses >= 1 and downloads.wait_s >= 0.2
    assert epoch.input_bound and downloads.wait_share >= DOWNLOAD_WAIT_SHARE
    # 12 KB shards: the requests, not the bytes, are the wait; more ahead would not fix that
    assert "--shard-size" in epoch.next_step() and "ahead=" not in epoch.next_step()


@pytest.mark.slow
def test_a_mix_counts_its_remote_source_downloads(url, tmp_path):
    remote = ShardedDataset(url, cache_dir=tmp_path, cache_limit="64MB")
    local = ShardedDataset(_local_shards(tmp_path / "local"))
    mix = Mix({"remote": remote, "local": local}, {"remote": 0.5, "local": 0.5})
    loader = DataLoader(mix, batch_size=16, seed=SEED)
    batches = list(loader)
    assert batches
    downloads = loader.stats.last.downloads
    assert downloads is not None and downloads.url == remote.url
    assert 0 < downloads.downloads <= len(remote.manifest.shards)
    assert downloads.requests == downloads.downloads


@pytest.mark.slow
def test_a_mix_reading_through_a_cache_too_small_for_its_order_is_told_the_size_that_holds_it(
    url, s3, tmp_path
):
    from benchmarks._fault_proxy import FaultProxy

    proxy = FaultProxy(s3.endpoint)
    try:
        probe = ShardedDataset(url, cache_dir=tmp_path / "probe", endpoint_url=proxy.endpoint)
        two_shards = 2 * max(shard.bytes for shard in probe.manifest.shards)
        remote = ShardedDataset(  # the order's minimum is 1 shard: a limit of 2 is accepted
            url,
            cache_dir=tmp_path / "cache",
            cache_limit=two_shards,
            lanes=1,
            window=1,
            ahead=0,
            endpoint_url=proxy.endpoint,
        )
        proxy.add("stall", count=10_000, match="shard-", argument=0.05)
        mix = Mix({"remote": remote, "local": Local()}, {"remote": 0.9, "local": 0.1})
        loader = DataLoader(mix, batch_size=16, seed=SEED)
        assert list(loader)
    finally:
        proxy.close()
    epoch = loader.stats.last
    downloads = epoch.downloads
    # a Mix reads its source in its own order: every shard at any time, through 2 shards' room
    assert not downloads.planned and downloads.evictions > 0
    assert downloads.downloads > len(remote.manifest.shards)  # fetched again after eviction
    assert downloads.hit_rate < LOW_HIT_RATE
    whole = human_size(remote.manifest.size_bytes)
    assert f"set cache_limit to {whole}" in epoch.next_step()


class Local:
    def __len__(self) -> int:
        return 90

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full((6, 6), -i, np.int32), "y": 1000 + i}


def _local_shards(folder):
    pack(Indexed(240, side=6), folder, shard_size=SHARD_SIZE, workers=0)
    return folder


def test_a_folder_of_shards_shows_nothing_new(tmp_path):
    dataset = ShardedDataset(_local_shards(tmp_path / "shards"))  # read in place: no cache
    loader = _loader(dataset)
    assert sorted(_epoch(loader)) == list(range(240))
    assert loader.stats.last.downloads is None
    assert "downloads" not in loader.stats.summary()
    assert loader.stats.as_dict()["epochs"][0]["downloads"] is None


# -- the advice: only what would change the wait ---------------------------------------------


def _epoch_with(downloads: DownloadStats, wait_s=8.0, first_wait_s=0.1, batches=100):
    """An ended epoch of 10 s in which training waited ``wait_s`` for data."""
    stats = EpochStats(epoch=0, batches=batches, samples=batches * 10, wait_s=wait_s)
    stats.first_batch_wait_s, stats.complete, stats.workers = first_wait_s, True, 2
    stats._started_at, stats._ended_at = 0.0, 10.0
    downloads.wall_s, downloads.processes = 10.0, 2
    stats.downloads = downloads
    return stats


def _big(**fields) -> DownloadStats:
    values = dict(
        wait_s=10.0,  # half of 2 processes x 10 s
        hits=900,
        misses=100,
        downloads=40,
        bytes_downloaded=40 * 64 * MB,
        requests=40,
        ahead=2,
        cache_limit=4096 * MB,
        cache_minimum=1024 * MB,
        cache_default=4096 * MB,
        more_ahead=4,
        cache_minimum_more_ahead=1536 * MB,
        shard_bytes=64 * MB,
    )
    return DownloadStats(**(values | fields))


def test_waiting_for_downloads_that_keep_up_asks_for_more_ahead_and_names_the_cache():
    step = _epoch_with(_big()).next_step()
    assert "ahead=4 (now 2)" in step and "1.5 GiB" in step and "raise it" not in step
    step = _epoch_with(_big(cache_limit=1200 * MB)).next_step()
    assert "ahead=4" in step and "raise it" in step  # the larger ahead needs a larger cache


def test_tiny_shards_ask_for_a_larger_shard_size_not_more_ahead():
    tiny = SMALL_SHARD_BYTES / 100
    step = _epoch_with(_big(shard_bytes=tiny, bytes_downloaded=40 * tiny)).next_step()
    assert "--shard-size 64MB" in step and "ahead=" not in step and "cache_limit" not in step


def test_a_thrashing_cache_asks_for_cache_limit_only_below_the_useful_size():
    misses = int(1000 * (1 - LOW_HIT_RATE)) + 100
    thrash = dict(hits=1000 - misses, misses=misses, evictions=30, cache_limit=1100 * MB)
    step = _epoch_with(_big(**thrash)).next_step()
    assert "set cache_limit to 4.0 GiB" in step and "1.0 GiB" in step  # useful, and minimum
    # at the default size already, a larger cache would not change the misses
    step = _epoch_with(_big(**(thrash | {"cache_limit": 4096 * MB}))).next_step()
    assert "set cache_limit" not in step and "ahead=" in step
    # evictions with a high hit rate are a cache smaller than the dataset, not a problem
    step = _epoch_with(_big(evictions=30, cache_limit=1100 * MB)).next_step()
    assert "set cache_limit" not in step


def test_an_order_nothing_downloads_ahead_of_is_told_the_sampler_or_the_whole_dataset():
    unplanned = dict(planned=False, dataset_bytes=100_000 * MB)
    step = _epoch_with(_big(**unplanned)).next_step()
    assert "ShardOrderSampler(dataset, batch_size)" in step and "ahead=" not in step
    misses = int(1000 * (1 - LOW_HIT_RATE)) + 100
    thrash = dict(hits=1000 - misses, misses=misses, evictions=30)
    step = _epoch_with(_big(**unplanned, **thrash)).next_step()
    assert "set cache_limit to 97.7 GiB" in step  # its working set: the whole dataset
    # a cache that holds the whole dataset already: no cache advice
    step = _epoch_with(_big(**(unplanned | thrash | {"cache_limit": 100_000 * MB}))).next_step()
    assert "set cache_limit" not in step and "ShardOrderSampler" in step


def test_no_download_advice_when_it_would_not_change_the_wait():
    # the model is the bottleneck: downloads that waited do not slow training
    assert "nothing to change" in _epoch_with(_big(), wait_s=0.2).next_step()
    # the wait is the epoch's first shards, which nothing downloads ahead of
    step = _epoch_with(_big(), wait_s=8.0, first_wait_s=7.5).next_step()
    assert step.startswith("nothing to change") and "first shards" in step
    # downloads a small share of the loading time: the usual advice, no download option
    step = _epoch_with(_big(wait_s=0.5)).next_step()
    assert "ahead" not in step and "shard" not in step and "cache_limit" not in step


def test_the_summary_line_gives_the_download_figures():
    line = _epoch_with(_big(evictions=3)).summary()
    assert "downloads 40 shards 2.5 GiB in 40 requests (4.0/s, 256.0 MiB/s)" in line
    assert "readers waited 10.00 s (50% of loading), hit rate 90%, 3 evicted" in line
