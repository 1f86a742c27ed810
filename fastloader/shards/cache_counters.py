"""The shard cache's counters: each process's ``CacheStats`` in the cache folder's ``.stats``,
named by ``process_key`` (NOTE [ The shard cache ] in cache.py, NOTE [ Download stats ] in
stats/downloads.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "CacheStats",
    "added_up",
    "process_key",
    "read_counters",
    "retire_ended",
    "write_counters",
]

RETIRED = "retired"  # file name prefix: ``retired-HOST.json``
_RETIRE_AFTER_S = 3600.0  # a dead process's file is folded once this old (an epoch may read it)


@dataclass
class CacheStats:
    """What this process's cache did: downloads, bytes, waits, hits."""

    downloads: int = 0
    bytes_downloaded: int = 0
    hits: int = 0
    misses: int = 0
    wait_seconds: float = 0.0
    evictions: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 1.0


def process_key(pid: int | None = None) -> str:
    """``HOST-PID-START`` of process ``pid`` (default: this one), START its start time in clock
    ticks since boot (``/proc/PID/stat``; 0 where that cannot be read, as off Linux): the name
    of its counters, on Linux never the same for two processes of one boot (a container
    restarted in place reuses host names and pids)."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            start = file.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        start = "0"
    return f"{socket.gethostname()}-{pid}-{start}"


def write_counters(folder: Path, key: str, stats: CacheStats) -> None:
    """Replace ``folder/KEY.json`` with ``stats`` (best effort: a full disk skips it)."""
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
        write_json(folder / f"{key}.json", asdict(stats))


def write_json(target: Path, value: Any) -> None:
    """Replace ``target`` with ``value`` as JSON, whole: threads of one process (the
    download-ahead's and the reader's) write through temporary files of their own."""
    temp = target.with_name(f".{target.name}.partial-{threading.get_ident()}")
    temp.write_text(json.dumps(value))
    os.replace(temp, target)


def read_counters(folder: Path, keys: Iterable[str] | None = None) -> dict[str, CacheStats]:
    """The counters in ``folder`` by key: all (each host's ended processes' as one,
    ``retired-HOST``: ``retire_ended``), or those of ``keys``; unreadable ones skipped."""
    if keys is not None:
        return _read(folder / f"{key}.json" for key in keys)
    found, folded = {}, set()
    for path in folder.glob(f"{RETIRED}-*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            retired = json.loads(path.read_text())
            found[path.stem] = CacheStats(**retired["total"])
            folded |= set(retired["folded"])  # counted in the total, their files not gone yet
    paths = folder.glob("*.json")
    return found | _read(
        p for p in paths if not p.stem.startswith(RETIRED) and p.stem not in folded
    )


def _read(paths: Iterable[Path]) -> dict[str, CacheStats]:
    found = {}
    for path in paths:
        with contextlib.suppress(OSError, ValueError, TypeError):
            found[path.stem] = CacheStats(**json.loads(path.read_text()))
    return found


def added_up(counters: Iterable[CacheStats]) -> CacheStats:
    """The sum of ``counters``."""
    total = CacheStats()
    for stats in counters:
        for field in fields(CacheStats):
            setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
    return total


def retire_ended(folder: Path) -> None:
    """Fold the counters of this host's processes that have ended (their key no longer names a
    live process) into ``retired-HOST.json`` and delete their files, so that ``.stats`` holds a
    file per live process and one per host, not one per process that ever used the cache
    (a loader without persistent workers starts new ones every epoch). Only files an hour old
    (an epoch reads its processes' files when it ends), and only keys with a start time (off
    Linux none is known). The caller holds the folder's lock (``ShardCache``). Exact across a
    crash: the retired file lists the keys it holds until their files are gone."""
    host = socket.gethostname()
    retired_path = folder / f"{RETIRED}-{host}.json"
    try:
        retired = json.loads(retired_path.read_text())
        total, folded = CacheStats(**retired["total"]), set(retired["folded"])
    except (OSError, ValueError, TypeError, KeyError):
        total, folded = CacheStats(), set()
    now, ended = time.time(), []
    for path in folder.glob(f"{host}-*.json"):
        key = path.stem
        if key in folded or not _ended(key, host, path, now):
            continue
        with contextlib.suppress(OSError, ValueError, TypeError):
            total = added_up([total, CacheStats(**json.loads(path.read_text()))])
            ended.append(key)
    if not ended and not folded:
        return
    folded |= set(ended)
    write_json(retired_path, {"total": asdict(total), "folded": sorted(folded)})
    for key in sorted(folded):
        with contextlib.suppress(FileNotFoundError):
            os.remove(folder / f"{key}.json")
    write_json(retired_path, {"total": asdict(total), "folded": []})


def _ended(key: str, host: str, path: Path, now: float) -> bool:
    pid, _, start = key[len(host) + 1 :].partition("-")
    if not pid.isdigit() or not start.isdigit() or start == "0":
        return False
    try:
        if now - path.stat().st_mtime < _RETIRE_AFTER_S:
            return False
    except OSError:
        return False
    return process_key(int(pid)) != key
