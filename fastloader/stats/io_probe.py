"""How much a process read from storage: bytes, major page faults, CPU time (Linux /proc).

Runs in the main process; it reads the counters of any process it may see (its own, or the
DataLoader's workers by pid). ``fastloader.stats.timing`` uses it to tell "input-bound on I/O: your
data does not fit in memory" from "input-bound on decoding" (see NOTE [ Telling I/O from
decode ]). Where ``/proc`` is missing (not Linux, or a sandbox hiding it) every counter is None
and no verdict is given.

NOTE [ Telling I/O from decode ]
A loader is input-bound when the training loop waits for batches. Whether more workers, a
cheaper transform, or more memory is the fix depends on where the workers' time goes: on the
CPU (decoding, transforms) or waiting for the disk. Three counters per worker tell it:
``read_bytes`` of ``/proc/<pid>/io`` (bytes the process caused to be read from storage, page
cache misses included, read-ahead and ``WILLNEED`` too), the major faults of
``/proc/<pid>/stat`` (faults on a file map that had to wait for the disk), and the CPU time of
the same file. Workers that read about a record's bytes or more from storage per sample while
busy on the CPU for well under their wall time are waiting for the disk: the data is not in the
page cache (it does not fit in memory, or was just evicted). Read per sample far above the
record's size means read-ahead amplification: each sample pulls in bytes it does not use.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from typing import NamedTuple

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

__all__ = ["IOCounters", "io_verdict", "read_counters", "sum_counters"]


class IOCounters(NamedTuple):
    """Cumulative counters of one process (or a sum); None where unavailable."""

    read_bytes: int | None  # from storage (page-cache misses), /proc/<pid>/io
    major_faults: int | None  # faults that waited for storage
    cpu_seconds: float | None  # user + system

    def __sub__(self, other: IOCounters) -> IOCounters:  # type: ignore[override]
        return IOCounters(*(_minus(a, b) for a, b in zip(self, other, strict=True)))


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _read_bytes(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as file:
            for line in file:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _stat_counters(pid: int | str) -> tuple[int | None, float | None]:
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
        fields = text[text.rindex(")") + 2 :].split()
        # after "pid (comm) ": state is field 3, majflt 12, utime 14, stime 15 (1-based)
        return int(fields[9]), (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, ValueError, IndexError):
        return None, None


def read_counters(pid: int | None = None) -> IOCounters:
    """The counters of process ``pid`` (default: this process), cumulative since it started.

    Never raises: a counter that cannot be read (no ``/proc``, a process gone or not ours) is
    None.
    """
    if pid is None or pid == os.getpid():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return IOCounters(_read_bytes("self"), usage.ru_majflt, usage.ru_utime + usage.ru_stime)
    faults, cpu = _stat_counters(pid)
    return IOCounters(_read_bytes(pid), faults, cpu)


def sum_counters(pids: Iterable[int]) -> IOCounters:
    """The counters of several processes (DataLoader workers) added; None if any is None."""
    total = IOCounters(0, 0, 0.0)
    for pid in pids:
        counters = read_counters(pid)
        total = IOCounters(*(_plus(a, b) for a, b in zip(total, counters, strict=True)))
    return total


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def io_verdict(
    delta: IOCounters,
    samples: int,
    seconds: float,
    processes: int,
    record_bytes: float | None = None,
) -> str | None:
    """A one-line diagnosis when workers waited on storage, else None.

    See NOTE [ Telling I/O from decode ].

    Args:
        delta: the workers' counters over a stretch of loading (``after - before``, summed).
        samples: samples loaded in that stretch.
        seconds: its wall time.
        processes: how many worker processes ``delta`` sums.
        record_bytes: the mean stored size of a sample, if known (a pack's file size over its
            length): read per sample is compared with it.
    """
    if delta.read_bytes is None or samples <= 0 or seconds <= 0 or processes <= 0:
        return None
    per_sample = delta.read_bytes / samples
    if per_sample < 4096 or (record_bytes and per_sample < 0.5 * record_bytes):
        return None  # served from the page cache
    busy = None if delta.cpu_seconds is None else delta.cpu_seconds / (seconds * processes)
    if busy is not None and busy > 0.7:
        return None  # reading from disk, but the CPU is what limits
    text = (
        f"input-bound on I/O: workers read {per_sample / 1024:.0f} KiB from storage per sample"
        + (f" and were busy {100 * busy:.0f}% of the time" if busy is not None else "")
        + ": your data does not fit in memory (the page cache). Use a pack (one file, read "
        "with read advice) rather than a folder of files, a smaller store (store='jpeg' or a "
        "smaller short_side), more RAM, or faster storage"
    )
    if record_bytes and per_sample > 2 * record_bytes:
        text += (
            f"; {per_sample / record_bytes:.1f}x the {record_bytes / 1024:.0f} KiB a sample "
            "needs: read-ahead pulls in bytes no sample uses (check the disk's read_ahead_kb)"
        )
    return text
