"""The shard cache's counters: each process's ``CacheStats`` in the cache folder's ``.stats``,
named by ``process_key`` (NOTE [ The shard cache ] in cache.py, NOTE [ Download stats ] in
stats/downloads.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["CacheStats", "added_up", "process_key", "read_counters", "write_counters"]


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
    of its counters. A container restarted in place reuses host names and pids; on Linux two
    processes of one boot share a key only with the same pid (in two pid namespaces) started
    in the same clock tick."""
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
    """The counters in ``folder`` by key: all, or those of ``keys``; unreadable ones skipped.
    A file stays for every process that ever used the folder (one small file each)."""
    paths = folder.glob("*.json") if keys is None else (folder / f"{key}.json" for key in keys)
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
