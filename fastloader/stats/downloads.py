"""One epoch's shard downloads: what the loading processes waited for, fetched and asked.

Runs in the main (training) process, at an epoch's start and end. Reads the datasets that
download shards to a node-local cache (``ShardedDataset.cache_counters``, found through
``Mix``, ``ConcatDataset``, ``Subset`` and wrappers, by duck typing: stats/ sits above
datasets/ and imports none of it).

NOTE [ Download stats ]
The cache writes each process's cumulative counters to its folder (NOTE [ The shard cache ] in
shards/cache.py). An epoch's figures are the change, over the epoch, of the counters of this
rank's loading processes: its workers and its training process (whose thread downloads ahead).
Other ranks on the node are theirs to report (``dataset.cache_stats()`` adds up the node).
Processes are told apart by ``process_key`` (host, pid and start time; on Linux), so counters
an earlier process with the same pid left (a container restarted in place) are never taken for
a new one's, and an epoch reads only its processes' files. A process seen for the first time,
or whose counters went down (a cache made again in the same process), counts whole. A worker
that replaces one mid-epoch is not among the epoch's processes: its reads count from the next
epoch on. A process writes its hits at most once a second, so a few of an epoch's last
hits may count in the next epoch; misses, waits, downloads, bytes and requests are written as
they happen.

The advice (only when training is input-bound, and readers waited for downloads at least
``DOWNLOAD_WAIT_SHARE`` of the loading processes' time) names the one option that changes the
wait, and says "nothing to change" when none would:
- a hit rate below ``LOW_HIT_RATE`` with evictions: shards are evicted before they are read
  again and fetched again. For the shard-aware order, with a ``cache_limit`` below the default
  (``cache_default``, a multiple of the order's minimum): raise it to the default (at or above
  it, a larger cache would not change the misses). For another order (a ``Mix``'s, torch's
  sampler: nothing planned its reads), whose working set is the whole dataset: a
  ``cache_limit`` of the dataset's size, if it is below;
- shards smaller than ``SMALL_SHARD_BYTES``: each download is a request's latency more than
  its bytes, and each shard a request: repack with a larger ``--shard-size`` (fewer requests
  per second, too);
- an order nothing downloads ahead of (not a ``ShardOrderSampler``'s): that sampler, outside a
  ``Mix``;
- a wait mostly at the epoch's start: the epoch's first shards, which nothing downloads ahead
  of: nothing to change;
- else downloads ahead did not keep up: raise ``ahead`` (doubled), naming the cache the order
  then needs. On a link already saturated, more ahead smooths bursts but does not add bytes
  per second: the download rate is in the summary to judge that.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from fastloader.formats.metadata import human_size
from fastloader.shards.cache_counters import process_key

#: Readers waiting for downloads this share of the loading processes' time is worth a change.
DOWNLOAD_WAIT_SHARE = 0.10
#: Shards smaller than this: the request, not the bytes, is most of a download's time.
SMALL_SHARD_BYTES = 8 << 20
#: Readers that found their shard in the cache less often than this, with evictions: the
#: cache is evicting shards the order still reads.
LOW_HIT_RATE = 0.90
_COUNTERS = ("hits", "misses", "wait_seconds", "downloads", "bytes_downloaded", "requests")
_COUNTERS += ("evictions",)


@dataclasses.dataclass
class DownloadStats:
    """One epoch's shard downloads by this rank's loading processes (NOTE [ Download stats ]).

    Attributes:
        wait_s: seconds readers waited for shards to download (summed over processes).
        hits, misses: reads that found their shard in the cache, or did not.
        downloads, bytes_downloaded, requests: shards fetched, their bytes, the requests sent.
        evictions: shards deleted to make room.
        wall_s: the epoch's wall time; processes: the processes that loaded (workers, or 1).
        url: the dataset's URL (the first one's, for several); ahead, cache_limit,
            cache_minimum, cache_default, more_ahead, cache_minimum_more_ahead, shard_bytes,
            dataset_bytes: its settings, for the advice; planned: whether a
            ``ShardOrderSampler`` planned the reads (shards downloaded ahead).
    """

    wait_s: float = 0.0
    hits: int = 0
    misses: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    requests: int = 0
    evictions: int = 0
    wall_s: float = 0.0
    processes: int = 1
    url: str = ""
    ahead: int = 0
    cache_limit: int = 0
    cache_minimum: int = 0
    cache_default: int = 0
    more_ahead: int = 1
    cache_minimum_more_ahead: int = 0
    shard_bytes: float = 0.0
    dataset_bytes: int = 0
    planned: bool = True

    @property
    def hit_rate(self) -> float:
        """Reads that found their shard in the cache, over all reads (1.0 with no reads)."""
        asked = self.hits + self.misses
        return self.hits / asked if asked else 1.0

    @property
    def wait_share(self) -> float:
        """The share of the loading processes' time spent waiting for downloads (0-1)."""
        spent = self.processes * self.wall_s
        return min(1.0, self.wait_s / spent) if spent > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_downloaded / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        """``downloads 12 shards 768.0 MB in 14 requests (2.3/s, 12.1 MB/s), readers waited
        2.1 s (35% of loading), hit rate 93%, 3 evicted``."""
        line = (
            f"downloads {self.downloads} shards {human_size(self.bytes_downloaded)} in "
            f"{self.requests} requests ({self.requests_per_s:.1f}/s, "
            f"{human_size(self.bytes_per_s)}/s), readers waited {self.wait_s:.2f} s "
            f"({100 * self.wait_share:.0f}% of loading), hit rate {100 * self.hit_rate:.0f}%"
        )
        return line + (f", {self.evictions} evicted" if self.evictions else "")

    def as_dict(self) -> dict[str, Any]:
        """The fields and derived figures, JSON-able."""
        return dataclasses.asdict(self) | {
            "hit_rate": self.hit_rate,
            "wait_share": self.wait_share,
            "requests_per_s": self.requests_per_s,
            "bytes_per_s": self.bytes_per_s,
        }


def cached_sources(dataset: Any, depth: int = 0) -> tuple[Any, ...]:
    """The datasets under ``dataset`` that download shards to a cache (``cache_counters``)."""
    if dataset is None or depth > 8:
        return ()
    if callable(getattr(dataset, "cache_counters", None)):
        return (dataset,)  # a folder read in place gives None: snapshot leaves it out
    parts = getattr(dataset, "datasets", None)  # Mix (a dict), ConcatDataset (a list)
    if isinstance(parts, dict):
        parts = list(parts.values())
    if isinstance(parts, (list, tuple)):
        return tuple(found for part in parts for found in cached_sources(part, depth + 1))
    return cached_sources(getattr(dataset, "dataset", None), depth + 1)  # Subset, wrappers


def loader_keys(pids: Iterable[int]) -> frozenset[str]:
    """The counters' keys (``process_key``) of processes ``pids`` and of this one."""
    return frozenset(process_key(pid) for pid in (*pids, os.getpid()))


def snapshot(sources: Iterable[Any], keys: frozenset[str]) -> list[dict[str, Any]]:
    """Each source's ``cache_counters`` of processes ``keys`` now."""
    found = (source.cache_counters(keys) for source in sources)
    return [counters for counters in found if counters is not None]


def epoch_downloads(
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    keys: frozenset[str],
    wall_s: float,
    processes: int,
) -> DownloadStats | None:
    """The change from ``before`` to ``after`` of the counters of processes ``keys``
    (``loader_keys``), added up over sources; None without sources."""
    if not after:
        return None
    first = after[0]
    settings = {field: first[field] for field in _SETTINGS if field in first}
    total = DownloadStats(wall_s=wall_s, processes=max(1, processes), **settings)
    for start, end in zip(before, after, strict=False):
        for key in keys & end["processes"].keys():
            _add(total, start["processes"].get(key), end["processes"][key])
    return total


_SETTINGS = ("url", "ahead", "cache_limit", "cache_minimum", "cache_default", "more_ahead")
_SETTINGS += ("cache_minimum_more_ahead", "shard_bytes", "dataset_bytes", "planned")


def _add(total: DownloadStats, start: Any, end: Any) -> None:
    """Add one process's counters' change (whole when it is new or started again)."""
    values = {name: getattr(end, name, 0) for name in _COUNTERS}
    if start is not None:
        earlier = {name: getattr(start, name, 0) for name in _COUNTERS}
        if all(values[name] >= earlier[name] for name in _COUNTERS):
            values = {name: values[name] - earlier[name] for name in _COUNTERS}
    total.wait_s += values.pop("wait_seconds")
    for name, value in values.items():
        setattr(total, name, getattr(total, name) + value)


def download_advice(stats: Any, downloads: DownloadStats) -> str | None:
    """The next step when readers waited for downloads a meaningful share of the loading
    time, else None (NOTE [ Download stats ])."""
    if downloads.wait_share < DOWNLOAD_WAIT_SHARE:
        return None
    waited = (
        f"readers waited for shard downloads {100 * downloads.wait_share:.0f}% of the loading "
        f"time ({downloads.wait_s:.1f} s)"
    )
    thrash = _thrash_advice(downloads)
    if thrash is not None:
        return f"{waited}, with a hit rate of {100 * downloads.hit_rate:.0f}% and " + thrash
    if downloads.shard_bytes < SMALL_SHARD_BYTES:
        return (
            f"{waited}; shards average {human_size(downloads.shard_bytes)}, so each download "
            "is mostly a request's latency: repack with larger shards (fastloader-pack "
            "--shard-size 64MB): fewer, larger requests"
        )
    if not downloads.planned:
        return (
            f"{waited}: nothing downloads ahead of this order (not a ShardOrderSampler's: a "
            "Mix's, or torch's sampler): each shard is fetched when first read; outside a Mix "
            "pass sampler=fastloader.ShardOrderSampler(dataset, batch_size)"
        )
    if stats.start_wait_s >= stats.worker_wait_s:
        return (
            f"nothing to change: {waited}, mostly at the epoch's start, for its first shards, "
            "which nothing downloads ahead of"
        )
    return (
        f"{waited}: downloads ahead of the order did not keep up: set ahead="
        f"{downloads.more_ahead} (now {downloads.ahead}) in ShardedDataset; the cache then "
        f"needs at least {human_size(downloads.cache_minimum_more_ahead)}"
        + (
            f" (cache_limit is {human_size(downloads.cache_limit)}: raise it)"
            if downloads.cache_limit < downloads.cache_minimum_more_ahead
            else ""
        )
    )


def _thrash_advice(downloads: DownloadStats) -> str | None:
    """``cache_limit`` advice when the cache evicts shards the order reads again, and a
    larger one would hold them: the default for the shard-aware order, the whole dataset for
    another (its working set)."""
    if not downloads.evictions or downloads.hit_rate >= LOW_HIT_RATE:
        return None
    evicted = f"{downloads.evictions} shards evicted: "
    limit = human_size(downloads.cache_limit)
    if not downloads.planned:
        if downloads.cache_limit >= downloads.dataset_bytes:
            return None
        return (
            f"{evicted}an order that is not the shard-aware one (a Mix's, torch's sampler) "
            f"reads the whole dataset at once, and cache_limit {limit} is below it: set "
            f"cache_limit to {human_size(downloads.dataset_bytes)}, or read it with "
            "ShardOrderSampler outside a Mix"
        )
    if downloads.cache_limit >= downloads.cache_default:
        return None
    return (
        f"{evicted}cache_limit {limit} is close to what the order needs at once "
        f"({human_size(downloads.cache_minimum)}), so shards are evicted before they are read "
        f"and fetched again: set cache_limit to {human_size(downloads.cache_default)}"
    )
