"""``ShardedDataset``: one map-style dataset over the shards of a sharded pack, local or remote.

NOTE [ Reading a sharded pack ]
Index ``i`` is sample ``i - start[s]`` of shard ``s`` (shards numbered in manifest order), so a
sharded pack reads as one pack: per-sample seeding by global index, ``Mix``, resume. A folder
(a local disk or a shared file system) is read in place: no copies. A URL's shards come through
the node-local cache (NOTE [ The shard cache ] in shards/cache.py): a process asks the cache for
a shard when it first reads it, and the main process downloads ahead of the order
(``plan_reads``, called by ``ShardOrderSampler``). Each process keeps at most ``open_shards``
shards open (least recently read closed first), and closes a shard the cache evicted as soon as
it notices (its next batch), so evicted bytes are freed. Nothing per-process is pickled: the
dataset holds the manifest and options only, and every process opens its own shards and its
own client (NOTE [ One client per process ] in shards/s3.py).
"""

from __future__ import annotations

import os
import resource
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from fastloader.datasets.columns import ColumnBatch
from fastloader.datasets.packs import open_pack
from fastloader.datasets.shard_checks import check_agrees
from fastloader.datasets.shard_gather import ShardMaps
from fastloader.datasets.sharded_columns import (
    column_plan,
    read_columns_by_shard,
    read_shard_columns,
)
from fastloader.formats.packfile import file_identity
from fastloader.formats.records import PackError
from fastloader.shards.cache import ShardCache, cache_minimum
from fastloader.shards.manifest import Manifest
from fastloader.shards.sizes import parse_size
from fastloader.shards.stores import is_url, open_store, read_manifest

__all__ = ["ShardedDataset"]

_DEFAULT_LANES, _DEFAULT_WINDOW = 8, 4  # what ShardOrderSampler takes by default
_DEFAULT_CACHE = 4  # the default cache_limit: this many times the order's minimum
_OPEN_AT_LEAST = 256  # NOTE [ How many shards stay open ]
_RECHECK_S = 0.1  # NOTE [ A shard changed on disk ]

# NOTE [ How many shards stay open ]
# Opening a shard costs 3-5 ms (its metadata, checksums and column table), so a process keeps
# shards open, least recently read closed first. At exactly the order's working set
# (``lanes * window``) that LRU reopens cyclically: the lanes change windows at different
# positions, and the batches a worker has in flight straddle the change (171 shards, lanes 8,
# window 4, batch 64: 304 opens an epoch with 33 open, 178 with 65). Twice the working set ends
# that; keeping at least 256 (or all the shards, when fewer) open lets the next epoch read
# without reopening (the same run: 0 opens in the second epoch, 6x faster). Each open shard holds
# two file descriptors and read-only maps of its file, so the 256 shrinks under a low limit on
# open files (to use at most an eighth of it); a shard the cache evicted is closed at the next batch
# (``_forget_evicted``), so the cache's limit still bounds the bytes held.


def _default_open_shards(shards: int, lanes: int, window: int) -> int:
    """NOTE [ How many shards stay open ]."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    keep = _OPEN_AT_LEAST if files == resource.RLIM_INFINITY else min(_OPEN_AT_LEAST, files // 16)
    return min(shards, max(2 * lanes * window + 1, keep))


class ShardedDataset(Dataset):
    """A sharded pack (``fastloader-pack SRC DST --shard-size 64MB``) as one map-style dataset.

    Args:
        path_or_url: a folder of shards (read in place) or ``s3://bucket/prefix``.
        cache_dir: for a URL: the node-local folder shards are downloaded to (default
            ``$FASTLOADER_CACHE`` or ``~/.cache/fastloader/shards``).
        cache_limit: for a URL: the most bytes the cache may hold (``"50GB"``); default the
            minimum the order needs times 4. A limit below the minimum is refused.
        lanes, window: the shape of the shard-aware order (``ShardOrderSampler``; NOTE [ The
            shard-aware order ]): they set the working set, and so the minimum cache.
        ahead: shards downloaded ahead of the order, per rank.
        open_shards: shards kept open per process (default: twice the order's working set,
            at least 256 or every shard; NOTE [ How many shards stay open ]).
        endpoint_url: the S3 endpoint (default ``$AWS_ENDPOINT_URL``, else AWS).
        store_options: for a URL's client: ``retries``, ``timeout``, ``ranges`` (byte ranges
            fetched at once for a large shard, default 4) and ``range_min`` (see ``S3Store``).
        **pack_options: for every shard's pack: ``transform``, ``decode``, ...

    Raises:
        FileNotFoundError: without a manifest (not a sharded pack, or an unfinished one).
        ManifestError: for a manifest that cannot be trusted, naming the field.
        ValueError: for a ``cache_limit`` below the order's working set, naming the minimum.
        ImportError: for a URL without the ``remote`` extra.
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike,
        *,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
        lanes: int = _DEFAULT_LANES,
        window: int = _DEFAULT_WINDOW,
        ahead: int = 2,
        open_shards: int | None = None,
        endpoint_url: str | None = None,
        store_options: dict[str, Any] | None = None,
        **pack_options: Any,
    ) -> None:
        options = dict(store_options or {})
        if endpoint_url is not None:
            options["endpoint_url"] = endpoint_url
        self.store = open_store(path_or_url, **options)
        self.url = self.store.url
        self.manifest: Manifest = read_manifest(self.store)
        self.lanes, self.window, self.ahead = lanes, window, ahead
        self.shard_counts = np.array([s.count for s in self.manifest.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.shard_counts)])
        self._start_list = self._starts.tolist()
        self.classes = list(self.manifest.classes)
        self.pack_options = pack_options
        self.open_shards = open_shards or _default_open_shards(
            len(self.manifest.shards), lanes, window
        )
        self.cache: ShardCache | None = None
        self.planned = False  # a ShardOrderSampler planned this rank's reads (plan_reads)
        if is_url(path_or_url) and self.store.local_path(self.manifest.shards[0].name) is None:
            biggest = max(s.bytes for s in self.manifest.shards)
            minimum = cache_minimum(biggest, len(self.manifest.shards), lanes, window, ahead)
            limit = (
                _DEFAULT_CACHE * minimum
                if cache_limit is None
                else parse_size(cache_limit, "cache_limit")
            )
            self.cache = ShardCache(self.store, self.manifest, cache_dir, limit, minimum)
        self._reset()

    def _reset(self) -> None:
        shards = len(self.manifest.shards)
        self._open: dict[int, Any] = {}
        self._pid = os.getpid()
        self._reads = 0  # batches read in this process
        self._last_read = np.zeros(shards, dtype=np.int64)  # per shard: _reads at its last read
        self._touched = np.full(shards, -np.inf)  # per shard: when it was last marked used
        self._checked = np.full(shards, -np.inf)  # per shard: when its identity was last checked
        self._cache_changed: int | None = None  # the cache folder's mtime at the last look
        self._maps: ShardMaps | None = None  # NOTE [ One gather across shards ]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_open={}, _pid=None, _maps=None)  # opened again where it is read
        return state

    def __len__(self) -> int:
        return int(self._starts[-1])

    def shard_of(self, index: int) -> int:
        """The shard (manifest order) that holds sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.url}: index {index} out of range ({len(self)} samples)")
        return int(np.searchsorted(self._starts, index, side="right")) - 1

    def _shard(self, number: int) -> Any:
        """Shard ``number`` open in this process (NOTE [ Reading a sharded pack ])."""
        if self._pid != os.getpid():
            self._reset()  # a forked child: the parent's handles are not ours
        self._last_read[number] = self._reads
        pack = self._open.get(number)
        if pack is not None:
            return pack
        while len(self._open) >= self.open_shards:  # the least recently read closed first
            self._close_shard(min(self._open, key=self._last_read.__getitem__))
        for attempt in range(3):
            path = self._path(number)
            try:
                pack = open_pack(path, **self.pack_options)
                check_agrees(pack, self.manifest, number, path)
                pack.shard_identity = file_identity(path)  # NOTE [ A shard changed on disk ]
                pack.shard_inode = pack.shard_identity[1]  # see _forget_evicted
                pack.shard_columns = column_plan(pack)  # (plan, table): read_batch_columns
                break
            except FileNotFoundError:  # evicted between its download and this open: again
                if self.cache is None or attempt == 2:
                    raise
        self._open[number] = pack
        self._make_ready(number, pack)
        return pack

    def _make_ready(self, number: int, pack: Any) -> None:
        """Check every block of shard ``number`` and note where its columns lie, for batches
        read by one gather per column (NOTE [ One gather across shards ] in shard_gather.py).
        A damaged block leaves it to the per-shard path, which raises when its rows are read."""
        if pack.shard_columns is None:
            return
        plan, table = pack.shard_columns
        if pack.verify_checksums:
            try:
                table.check_rows(np.arange(table.count, dtype=np.int64))
            except PackError:
                return
        if self._maps is None:
            self._maps = ShardMaps(self._starts, plan)
        self._maps.add(number, table)

    def _close_shard(self, number: int) -> None:
        self._open.pop(number).close()
        if self._maps is not None:
            self._maps.remove(number)

    def _path(self, number: int) -> Path:
        shard = self.manifest.shards[number]
        if self.cache is not None:
            path = self.cache.ensure(shard)
            if path.is_symlink():  # NOTE [ A shard changed on disk ]
                raise PackError(
                    f"{path}: a symbolic link in the shard cache, not a shard it checked"
                )
            return path
        path = self.store.local_path(shard.name)
        assert path is not None
        size = path.stat().st_size
        if size != shard.bytes:
            raise PackError(f"{path}: {size} bytes, the manifest says {shard.bytes}")
        return path

    def _unchanged(self, pack: Any) -> Any:
        """``pack``, after checking that a shard read in place is still the file opened
        (NOTE [ A shard changed on disk ]); raises ``PackError`` naming it if not."""
        if self.cache is None:
            try:
                same = file_identity(pack.path) == pack.shard_identity
            except OSError:
                same = False
            if not same:
                raise PackError(
                    f"{pack.path}: this shard changed on disk since it was opened (rewritten, "
                    f"truncated, replaced or removed): its rows are not read; make the sharded "
                    f"pack again or restore the shard"
                )
        return pack

    def _forget_evicted(self) -> None:
        """Close shards the cache evicted (their bytes are freed once no one has them open):
        looked for when the cache folder changed (a shard evicted or replaced changes its
        mtime), and every 256th batch whatever it says (an mtime's granularity)."""
        if self.cache is None:
            return
        cache = self.cache
        try:
            changed = os.stat(cache.folder).st_mtime_ns
        except OSError:
            changed = None
        if changed == self._cache_changed and changed is not None and self._reads % 256:
            return
        self._cache_changed = changed
        gone = [n for n, p in self._open.items() if not cache.holds(p.path, p.shard_inode)]
        for number in gone:
            self._close_shard(number)

    def __getitem__(self, index: int) -> Any:
        return self.getitems_with([index], None)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        return self.getitems_with(indices, None)

    def getitems_with(
        self, indices: Sequence[int], before_each: Callable[[int], None] | None
    ) -> list[Any]:
        """The samples at ``indices``, each shard's read in one call; ``before_each(index)``
        runs before each sample loads (the loader seeds it there, by its global index)."""
        out: list[Any] = [None] * len(indices)
        for number, rows, slots in self._grouped_rows(indices):
            hook = None
            if before_each is not None:
                start = self._start_list[number]
                pending = iter([start + row for row in rows])
                hook = lambda _, g=pending: before_each(next(g))  # noqa: E731 - its global index
            samples = self._unchanged(self._shard(number)).getitems_with(rows, hook)
            for slot, sample in zip(slots, samples, strict=True):
                out[slot] = sample
        return out

    def read_batch_columns(self, indices: Sequence[int]) -> ColumnBatch | None:
        """The samples ``indices`` as one ``ColumnBatch`` (NOTE [ Batches read by columns ] in
        datasets/columns.py): one gather per column across the shards where every shard of the
        batch is ready (NOTE [ One gather across shards ] in shard_gather.py), else read by
        columns from each shard and put in the batch's order (NOTE [ A sharded batch read by
        columns ] in sharded_columns.py); None where the shards' samples need per-sample work.
        Raises as ``__getitems__``."""
        if self._pid != os.getpid():
            self._reset()  # once per batch, not per shard: a system call each
        maps = self._maps
        if maps is not None and len(indices):
            at = np.asarray(indices, dtype=np.int64)
            # an index out of range lies in shard -1 or len(shards): never ready (ShardMaps)
            shards = self._starts.searchsorted(at, side="right") - 1
            if at.ndim == 1 and maps.ready[shards].all():
                self._reads += 1
                if self._reads % 16 == 0:
                    self._note_reads(shards)
                    if not maps.ready[shards].all():  # evicted just now
                        return self._read_grouped(indices)
                return self._read_ready(at, shards, maps)
        return self._read_grouped(indices)

    def _read_ready(self, at: np.ndarray, shards: np.ndarray, maps: ShardMaps) -> ColumnBatch:
        """Indices ``at`` of shards ``shards``, every one ready (``read_batch_columns``)."""
        if self.cache is None:  # NOTE [ A shard changed on disk ]
            now = time.monotonic()
            due = self._checked[shards] <= now - _RECHECK_S
            if due.any():
                for number in np.unique(shards[due]).tolist():
                    self._unchanged(self._open[number])
                    self._checked[number] = now
        columns = maps.fixed_columns(shards, at)
        plan = maps.plan
        if len(columns) < len(plan):  # ragged and text columns: per shard
            rest = [number for number in range(len(plan)) if number not in columns]
            rows = at - self._starts[shards]
            groups = [
                (self._open[number].shard_columns[1], False, r, s)
                for number, r, s in _groups(shards.tolist(), rows.tolist())
            ]
            columns.update(read_columns_by_shard(groups, plan, len(at), rest))
        named = {name: columns[number] for number, (name, _) in enumerate(plan)}
        return ColumnBatch(named, len(at))

    def _read_grouped(self, indices: Sequence[int]) -> ColumnBatch | None:
        """``read_batch_columns`` shard by shard."""
        groups = self._grouped_rows(indices)
        if self._pid != os.getpid():
            self._reset()  # once per batch, not per shard: a system call each
        opened, plan = self._open, None
        for at, (number, rows, slots) in enumerate(groups):
            pack = opened.get(number)
            if pack is None:
                pack = self._shard(number)
            else:
                self._last_read[number] = self._reads
            self._unchanged(pack)
            if pack.shard_columns is None:
                return None
            plan = pack.shard_columns[0]
            groups[at] = (pack.shard_columns[1], pack.verify_checksums, rows, slots)
        return None if plan is None else read_shard_columns(groups, plan, len(indices))

    def _note_reads(self, shards: np.ndarray) -> None:
        """Every 16th batch (``shards``) and every batch read shard by shard: the shards
        marked read (for ``open_shards``), evicted shards closed, and the cache told which
        shards are in use (at most once a second each)."""
        self._last_read[shards] = self._reads
        if self._reads % 16 == 0:
            self._forget_evicted()
        if self.cache is None:
            return
        now = time.monotonic()
        due = self._touched[shards] <= now - 1.0
        if due.any():
            for number in np.unique(shards[due]).tolist():
                self._touched[number] = now
                self.cache.touch(self.manifest.shards[number])

    def _grouped_rows(self, indices: Sequence[int]) -> list[tuple[Any, list[int], list[int]]]:
        """Per shard read (in the order first read): its number, its rows and their batch
        positions, in batch order; each shard marked used in the cache (NOTE [ A sharded batch
        read by columns ])."""
        if self._pid != os.getpid():
            self._reset()
        wanted = [int(i) for i in indices]
        if wanted and (min(wanted) < 0 or max(wanted) >= len(self)):
            bad = next(i for i in wanted if not 0 <= i < len(self))
            raise IndexError(f"{self.url}: index {bad} out of range ({len(self)} samples)")
        starts = self._start_list
        numbers = [bisect_right(starts, index) - 1 for index in wanted]
        rows = [index - starts[number] for index, number in zip(wanted, numbers, strict=True)]
        groups = _groups(numbers, rows)
        self._reads += 1
        self._note_reads(np.array([number for number, _, _ in groups], dtype=np.int64))
        return groups

    def plan_reads(self, indices: np.ndarray) -> None:
        """The indices this rank reads next, in order: shards are downloaded ahead of them."""
        if self.cache is not None and len(indices):
            shards = np.searchsorted(self._starts, indices, side="right") - 1
            self.cache.plan(shards, self.ahead)
            self.planned = True  # for loader.stats: shards are downloaded ahead

    def reading_at(self, position: int) -> None:
        """How far this rank's order has been handed out (download-ahead follows it)."""
        if self.cache is not None:
            self.cache.reading_at(position)

    def cache_stats(self) -> Any:
        """The cache's counters over every process of this node that used it (``CacheStats``:
        hits, misses, hit_rate, wait_seconds, downloads, bytes_downloaded, requests, evictions),
        or None for a folder read in place."""
        return None if self.cache is None else self.cache.node_stats()

    def cache_counters(self, keys: Iterable[str] | None = None) -> dict[str, Any] | None:
        """What ``loader.stats`` reads of the cache (stats/downloads.py): the counters of each
        process (or of ``keys``) by ``process_key`` (cumulative) and the settings its advice
        names; None for a folder read in place."""
        if self.cache is None:
            return None
        sizes = [shard.bytes for shard in self.manifest.shards]
        more = max(1, 2 * self.ahead)
        minimum = [
            cache_minimum(max(sizes), len(sizes), self.lanes, self.window, ahead)
            for ahead in (self.ahead, more)
        ]
        return {
            "url": self.url,
            "processes": self.cache.process_stats(keys),
            "ahead": self.ahead,
            "cache_limit": self.cache.limit,
            "cache_minimum": minimum[0],
            "cache_default": _DEFAULT_CACHE * minimum[0],
            "more_ahead": more,
            "cache_minimum_more_ahead": minimum[1],
            "shard_bytes": sum(sizes) / len(sizes),
            "dataset_bytes": sum(sizes),
            "planned": self.planned,
        }

    def close(self) -> None:
        """Close every shard open in this process, and stop downloading ahead."""
        for number in list(self._open):
            self._close_shard(number)
        if self.cache is not None:
            self.cache.stop()

    def __repr__(self) -> str:
        where = "" if self.cache is None else f", cache={str(self.cache.folder)!r}"
        return (
            f"ShardedDataset({self.url!r}, {len(self)} samples in "
            f"{len(self.manifest.shards)} shards{where})"
        )


def _groups(numbers: list[int], rows: list[int]) -> list[tuple[int, list[int], list[int]]]:
    """Per shard (in the order first read): its number, its rows and their batch positions."""
    groups: dict[int, tuple[int, list[int], list[int]]] = {}
    for slot, (number, row) in enumerate(zip(numbers, rows, strict=True)):
        group = groups.get(number)
        if group is None:
            group = groups[number] = (number, [], [])
        group[1].append(row)
        group[2].append(slot)
    return list(groups.values())


# NOTE [ A shard changed on disk ]
# A shard is mapped: rewritten in place while open, its rows would be another file's bytes
# under block checksums already verified in this process (so never checked again), and cut
# shorter, touching a row past the new end kills the process with SIGBUS. So, as for a foreign
# HDF5 file (NOTE [ A file changed under a reader ] in formats/hdf5_foreign.py), a shard read
# in place has its identity (device, inode, size, mtime) taken when it is opened and compared
# again before a batch reads from it, when its last check is 0.1 s old or more (a ``stat``
# each: per batch, 32 shards of a batch cost a folder's warm epoch half its speed, and on
# NFS each is a round trip unless the attributes are cached, for up to a minute by default);
# a change is a PackError naming the shard. Batches read within 0.1 s of the change, and
# between a ``stat`` and the copy, may hold its new bytes: that window
# remains. A cached shard is the cache's (its eviction replaces files: ``_forget_evicted``),
# but a symbolic link there is none of its files and is refused. A shard replaced, before it
# is opened, by another pack's shard of the same size and schema is refused when it is opened,
# by the manifest's fingerprint of its metadata (NOTE [ Shard fingerprints ] in
# shards/manifest.py; a manifest of the previous release has none: run ``--verify`` then).
