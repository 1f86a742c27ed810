"""The node-local shard cache: whole shards downloaded once per node, verified, bounded in size.

NOTE [ The shard cache ]
One folder per sharded pack, ``CACHE_DIR/<hash of the URL>/``, marked as ours by a
``.fastloader-cache`` file; every rank and worker of a node shares it.

* One download per shard per node. A process that needs shard ``X`` takes an exclusive
  ``flock`` on ``.locks/X.lock``; holding it, it finds ``X`` present (someone finished it) or
  downloads it to ``.X.partial-PID@HOST``, checks its size and XXH3-64 checksum against the
  manifest, and renames it to ``X``. A shard with the wrong bytes is fetched once more, then
  refused naming the shard: it is never renamed into place, so never read. ``flock`` locks
  belong to the open file, so the kernel drops them when their process dies (SIGKILL
  included): a dead downloader never leaves a lock that blocks anyone, and the next one
  deletes its partial file (holding the lock, it knows no one else writes it). A forked child
  closes the lock files it inherited: NOTE [ Lock files across a fork ].
* A hard limit. Before a download, under ``.cache.lock``, the bytes of the shards present plus
  those being downloaded (their manifest sizes) must leave room; else the least recently read
  shards are evicted, each only if its lock can be taken (no one downloads it). Reads set a
  shard's access time (once a second per process; set explicitly, so ``noatime`` mounts do
  not matter), so the shards the order reads now are the most recent. Never its mtime: a
  pack reader takes a changed mtime for a changed file (formats/packfile.py). A process that
  has an evicted shard open closes it within 16 batches (datasets/sharded.py), so its bytes
  are freed. ``cache_limit`` below what the order needs at once
  (``cache_minimum``) is refused at start, naming the minimum: a smaller cache would evict
  shards still being read, and fetch them again and again.
* It deletes only what it downloaded: shard names from the manifest (plain names, checked)
  and its own partial files, inside the folder it marked.
* Download ahead: the main process of each rank runs ``ahead`` threads (one at least) that
  download the shards its order reads next, in the order it reads them, at most ``ahead``
  shards beyond the shard being read (``plan``): ``ahead`` downloads in flight at once, each
  of a large shard itself in parallel ranges (NOTE [ Parallel ranged GETs ] in s3.py). How
  deep: NOTE [ How far ahead ].
* Counters: each process writes its ``CacheStats`` (readers' hits and misses, seconds readers
  waited, downloads, bytes and requests, evictions) to ``.stats/KEY.json``, its ``process_key``
  (host, pid and the process's start time: a container restarted in place reuses host names
  and pids, and a new process must not be read as an old one's continuation);
  ``process_stats`` reads each process's (or those asked for), ``node_stats`` adds them up
  (workers included).
  ``requests`` are the store's requests made by this process since its cache was made (a
  store without a ``requests`` counter counts none).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.metadata import human_size
from fastloader.formats.records import PackError
from fastloader.shards.cache_counters import (
    CacheStats,
    added_up,
    process_key,
    read_counters,
    write_counters,
)
from fastloader.shards.manifest import Manifest, Shard, file_checksum
from fastloader.shards.stores import Store, temp_name

__all__ = ["CacheFullError", "ShardCache", "cache_minimum", "default_cache_dir"]

MARKER = ".fastloader-cache"
_HELD: set[int] = set()  # lock fds this process holds (closed in a forked child)
_WAIT_FOR_ROOM = 120.0  # seconds a download waits for shards being downloaded to finish


# NOTE [ Lock files across a fork ]
# A flock belongs to the open file, which a forked child shares: a child that kept an inherited
# lock fd would keep its parent's lock alive after the parent released it, and wait on itself
# when it asks for that shard (seen: a loader worker forked while the download-ahead thread
# opened a lock file). So every lock fd is registered in _HELD in the same step as it is opened,
# and unregistered in the same step as it is closed, both under _GUARD, which a fork also takes
# (os.register_at_fork): a child is never forked between the two, and closes every fd in _HELD.
# Closing a duplicate does not release the parent's lock (no LOCK_UN).
_GUARD = threading.Lock()


def _close_inherited_locks() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _GUARD.release()


os.register_at_fork(
    before=_GUARD.acquire, after_in_parent=_GUARD.release, after_in_child=_close_inherited_locks
)


class CacheFullError(OSError):
    """The cache has no room for a shard (its folder, what it holds and the limit named)."""


def default_cache_dir() -> Path:
    """``$FASTLOADER_CACHE``, else ``~/.cache/fastloader/shards``."""
    return Path(os.environ.get("FASTLOADER_CACHE") or "~/.cache/fastloader/shards").expanduser()


def cache_minimum(biggest: int, shards: int, lanes: int, window: int, ahead: int) -> int:
    """Bytes the order needs at once on this node: ``window`` shards per lane the node reads
    plus ``ahead`` per rank (NOTE [ The shard-aware order ] in sampling/shard_order.py). Under
    torchrun (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) a node reads about ``lanes / nodes`` lanes,
    plus one it shares with a neighbour; else all of them."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    nodes = max(1, world // max(1, local))
    node_lanes = lanes if nodes == 1 else min(lanes, -(-lanes // nodes) + 1)
    return min(shards, node_lanes * window + ahead * local) * biggest


@contextlib.contextmanager
def _locked(path: Path, flags: int = fcntl.LOCK_EX) -> Iterator[bool]:
    """Hold ``flock(flags)`` on ``path``; yields False when ``LOCK_NB`` could not take it."""
    with _GUARD:  # NOTE [ Lock files across a fork ]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _HELD.add(fd)
    try:
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        with _GUARD:
            _HELD.discard(fd)
            os.close(fd)  # drops the lock


class ShardCache:
    """A node-local cache of one sharded pack's shards (NOTE [ The shard cache ]).

    Picklable: a process that unpickles it has no lock and no thread of its parent's.
    """

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        cache_dir: str | os.PathLike | None,
        limit: int,
        minimum: int,
    ) -> None:
        if limit < minimum:
            raise ValueError(
                f"cache_limit {human_size(limit)} is below what the order needs at once on this "
                f"node: at least {human_size(minimum)} ({minimum} bytes: lanes x window shards "
                "plus the shards downloaded ahead); raise cache_limit or lower lanes/window"
            )
        self.store, self.limit = store, limit
        self.shards = list(manifest.shards)
        self.sizes = {shard.name: shard.bytes for shard in self.shards}
        key = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.folder = base / key
        (self.folder / ".locks").mkdir(parents=True, exist_ok=True)
        (self.folder / MARKER).write_text(store.url + "\n")
        self._local_state()

    def _local_state(self) -> None:
        self.stats = CacheStats()
        self._touched: dict[str, float] = {}
        self._plan: tuple[np.ndarray, np.ndarray] | None = None
        self._position = 0
        self._ahead = self._next = 0  # how far ahead; the next shard of the plan to fetch
        self._threads: list[threading.Thread] = []
        self._wake = threading.Condition()  # guards _plan, _position, _ahead, _next
        self._stopped = False
        self._pid = os.getpid()
        self.plan_error: BaseException | None = None
        self._published = -2.0
        self._key_of: tuple[int, str] = (-1, "")  # (pid, process_key) of the counters' file
        self._requests_at_start = getattr(self.store, "requests", 0)

    def __getstate__(self) -> dict[str, Any]:
        keep = ("store", "limit", "shards", "sizes", "folder")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local_state()

    # -- reading ------------------------------------------------------------------------

    def path(self, shard: Shard) -> Path:
        return self.folder / shard.name

    def holds(self, path: Path, inode: int) -> bool:
        """Whether ``path`` is still the file (``inode``) a reader opened."""
        try:
            return os.stat(path).st_ino == inode
        except FileNotFoundError:
            return False

    def touch(self, shard: Shard) -> None:
        """Mark ``shard`` as read now (for least-recently-used eviction)."""
        now = time.monotonic()
        if now - self._touched.get(shard.name, -2.0) >= 1.0:
            self._touched[shard.name] = now
            path = self.path(shard)
            with contextlib.suppress(FileNotFoundError):  # atime only: NOTE [ The shard cache ]
                os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))

    def ensure(self, shard: Shard, *, reader: bool = True) -> Path:
        """The local path of ``shard``, downloaded (once per node) if it is not here.

        ``reader=False`` (downloads ahead) leaves the readers' hits, misses and waits alone.

        Raises:
            PackError: naming the shard, when its bytes twice did not match the manifest.
            CacheFullError: when no room could be made for it.
        """
        if self._pid != os.getpid():
            self._local_state()  # a forked child: the parent's counters and thread are not ours
        path = self.path(shard)
        if self._present(path, shard):
            self.stats.hits += reader
            self.touch(shard)
            self._publish(force=False)
            return path
        self.stats.misses += reader
        started = time.perf_counter()
        try:
            with _locked(self.folder / ".locks" / f"{shard.name}.lock"):
                if not self._present(path, shard):
                    self._download(shard, path)
                self.touch(shard)
        finally:
            self.stats.wait_seconds += (time.perf_counter() - started) * reader
            self._publish(force=True)
        return path

    def _publish(self, force: bool) -> None:
        """Write this process's counters to ``.stats/KEY.json`` (``process_key``; at most once
        a second unless ``force``), where ``node_stats`` adds them up."""
        now = time.monotonic()
        if not force and now - self._published < 1.0:
            return
        self._published = now
        self.stats.requests = getattr(self.store, "requests", 0) - self._requests_at_start
        if self._key_of[0] != os.getpid():
            self._key_of = (os.getpid(), process_key())
        write_counters(self.folder / ".stats", self._key_of[1], self.stats)

    def process_stats(self, keys: Iterable[str] | None = None) -> dict[str, CacheStats]:
        """Each process's counters (cumulative) by ``process_key``, as last written: every
        process's, or those of ``keys`` (an epoch reads its loader's only, however many
        processes used the folder before)."""
        return read_counters(self.folder / ".stats", keys)

    def node_stats(self) -> CacheStats:
        """The counters of every process that used this cache folder, added up (cumulative)."""
        return added_up(self.process_stats().values())

    def _present(self, path: Path, shard: Shard) -> bool:
        try:
            return path.stat().st_size == shard.bytes
        except FileNotFoundError:
            return False

    def _download(self, shard: Shard, path: Path) -> None:
        """Holding the shard's lock: fetch, check, rename (fetched once more on a bad check)."""
        where = f"{self.store.url.rstrip('/')}/{shard.name}"
        self._remove_partials(shard.name)
        for _attempt in (1, 2):  # a bad checksum: fetched once more
            temp = self.folder / temp_name(shard.name)
            self._reserve(shard, temp)
            try:
                streamed = self.store.download(shard.name, temp, size=shard.bytes)  # or ranges
                size = temp.stat().st_size  # the digest of one stream: NOTE [ Hashed on the way ]
                digest = (streamed or file_checksum(temp)) if size == shard.bytes else None
                if digest == shard.xxh3_64:
                    # counted and published before a reader can find it: an epoch that ends
                    # on this shard, read by another thread or process, counts its download
                    self.stats.downloads += 1
                    self.stats.bytes_downloaded += size
                    self._publish(force=True)
                    os.replace(temp, path)
                    return
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CacheFullError(
                        error.errno,
                        f"{self.folder}: the disk is full while downloading {where} "
                        f"({human_size(shard.bytes)}): free space or lower cache_limit",
                    ) from None
                raise
            finally:
                temp.unlink(missing_ok=True)
        raise PackError(
            f"{where}: its bytes do not match the manifest ({size} bytes, checksum {digest}; "
            f"the manifest says {shard.bytes} bytes, {shard.xxh3_64}), twice: refused"
        )

    # -- room ---------------------------------------------------------------------------

    def _remove_partials(self, name: str) -> None:
        """Partial files of ``name`` left by dead downloaders (we hold its lock)."""
        for stale in self.folder.glob(f".{name}.partial-*"):
            stale.unlink(missing_ok=True)

    def _reserve(self, shard: Shard, temp: Path) -> None:
        """Make room for ``shard`` under the limit, evicting least recently read shards; its
        partial file ``temp``, made here under the cache's lock, holds the room."""
        deadline = time.monotonic() + _WAIT_FOR_ROOM
        while True:
            with _locked(self.folder / ".cache.lock"):
                used, present = self._usage(shard.name)
                while used + shard.bytes > self.limit and present:
                    name, size = present.pop(0)
                    if self._evict(name):
                        used -= size
                if used + shard.bytes <= self.limit:
                    temp.touch()  # counted from now on by every process's _usage
                    return
            if time.monotonic() > deadline:
                raise CacheFullError(
                    errno.ENOSPC,
                    f"{self.folder}: no room for {shard.name} ({human_size(shard.bytes)}) within "
                    f"cache_limit {human_size(self.limit)}: {human_size(used)} are shards being "
                    "downloaded or read; raise cache_limit",
                )
            time.sleep(0.2)  # shards being downloaded by others hold their room: wait

    def _usage(self, downloading: str) -> tuple[int, list[tuple[str, int]]]:
        """Bytes held (shards present and partial downloads), and the shards present, least
        recently read first."""
        used, present = 0, []
        for entry in os.scandir(self.folder):
            name = entry.name
            if name in self.sizes and name != downloading:
                with contextlib.suppress(FileNotFoundError):
                    present.append((entry.stat().st_atime, name, entry.stat().st_size))
                    used += entry.stat().st_size
            elif name.startswith(".") and ".partial-" in name:
                owner = name[1:].split(".partial-")[0]
                used += self.sizes.get(owner, 0) if owner != downloading else 0
        present.sort()
        return used, [(name, size) for _, name, size in present]

    def _evict(self, name: str) -> bool:
        """Delete shard ``name`` unless someone holds its lock (downloading it)."""
        lock = self.folder / ".locks" / f"{name}.lock"
        with _locked(lock, fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
            if not taken:
                return False
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.folder / name)
                self.stats.evictions += 1
            return True

    # -- download ahead (the main process of each rank) ---------------------------------

    # NOTE [ How far ahead ]
    # ``ahead`` is both how many shards beyond the ones being read are fetched and how many are
    # in flight at once. The shards being read are those of the chunk of the order the sampler
    # hands out (256 positions, shard_order.py), so at the start of an epoch the threads fetch
    # the first batches' shards, in the order they are read, and the workers (which fetch a
    # shard themselves only when no one holds its lock) fetch fewer with clients of their own.
    # Measured (benchmarks/remote.py ``link_rows``: cold epochs of 6 000 samples in 19 shards
    # of 4 MB through a proxy, in a process of its own, that waits 50 ms to the first byte and
    # sends 100 MB/s per connection; 2 workers; three runs of 3 rounds on the shared 2-core box
    # at load 3-8): ahead 2 read a cold epoch 1.07-2.0x as fast as ahead 0 or 1 in every run
    # and ranges setting; ahead 4 0.87-1.15x as fast as ahead 2; 4 ranges per shard instead
    # of 1 (at ahead 2) 0.95-1.19x. So ``ahead=2`` (ShardedDataset's default): 4 was not
    # faster in every run and costs the main process CPU and cache room (``cache_minimum``
    # counts ``ahead`` shards per rank). The box's CPU, not the link, bounded these epochs.
    # Later, on the final code: 6 000 samples (load 1.4-2.9) ahead 4 0.94x ahead 2; 20 000
    # samples in 63 shards (load 1.6-4.6) ahead 4 1.48x (1 range) and 1.20x (4 ranges): a
    # larger dataset's window changes want more ahead, and ``loader.stats`` advises doubling
    # ``ahead`` (with the cache it needs) when readers' waits for downloads dominate.
    # Tried for the cold epoch and not kept (SeaweedFS on loopback, no proxy, 2 workers,
    # interleaved rounds, medians): 4 or 8 more threads while readers wait for shards not
    # fetched yet (an epoch's start), 0.94-1.04x the cold-epoch ratio of none (6 000 and 20 000
    # samples, load 2.3-3.8); spare downloads past ``ahead`` into room the order does not need
    # (one at a time, never evicting), 20 000 samples: cold epoch 2.37 s against 1.99 s
    # without, readers' waits 0.54 s against 0.43 s (8 rounds, load 4.8-5.3; two other runs
    # 2.37 vs 1.96 s, 4.94 vs 5.10 s through the 50 ms, 100 MB/s proxy, and at load 2.5-3
    # 1.86 vs 1.94 s with readers' waits 0.46 vs 0.67 s, the same ratio to the local pack).
    # The 2 cores bound these epochs: more downloads at once take CPU from the readers.

    def plan(self, shards: np.ndarray, ahead: int) -> None:
        """This rank reads ``shards[k]`` at its k-th read: download ahead of it (the shards
        not here now: a warm epoch wakes no thread)."""
        used = np.flatnonzero(np.bincount(shards, minlength=len(self.shards)))
        missing = [
            n for n in used.tolist() if not self._present(self.path(self.shards[n]), self.shards[n])
        ]
        order, first = _first_uses(shards, missing)
        with self._wake:
            self._plan, self._ahead, self._position, self._next = (order, first), ahead, 0, 0
            self._stopped = False
            if not len(order):  # all here (a warm epoch): no thread to start or wake
                return
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            while len(self._threads) < max(1, ahead):
                thread = threading.Thread(target=self._ahead_loop, daemon=True, name="shards")
                thread.start()
                self._threads.append(thread)
            self._wake.notify_all()

    def reading_at(self, position: int) -> None:
        with self._wake:
            self._position = position
            if self._claimable():  # else waking the threads only costs the reader the GIL
                self._wake.notify_all()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()

    def _claimable(self) -> bool:
        """Holding ``_wake``: whether the plan's next shard is within ``ahead`` of the
        reading."""
        if self._plan is None:
            return False
        order, first = self._plan
        reading = int(np.searchsorted(first, self._position, side="right"))
        return self._next < len(order) and self._next < reading + self._ahead

    def _claim(self) -> int | None:
        """Holding ``_wake``: the next shard of the plan to fetch, if it is not too far ahead."""
        if not self._claimable():
            return None
        self._next += 1
        return int(self._plan[0][self._next - 1])

    def _ahead_loop(self) -> None:
        while True:
            with self._wake:
                number = None
                while not self._stopped and (number := self._claim()) is None:
                    self._wake.wait(0.5)
                if self._stopped:
                    return
            try:
                self.ensure(self.shards[number], reader=False)
            except Exception as error:  # noqa: BLE001 - the reader meets it and raises
                self.plan_error = error
                return


def _first_uses(shards: np.ndarray, wanted: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The ``wanted`` shards in order of first use, and the read number of each first use."""
    if not wanted:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    unique, first = np.unique(np.asarray(shards), return_index=True)
    keep = np.isin(unique, wanted)
    unique, first = unique[keep], first[keep]
    by_time = np.argsort(first)
    return unique[by_time], first[by_time]
