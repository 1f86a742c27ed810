"""One epoch's timings: waits, throughput, workers' busy time (main process).

See NOTE [ The diagnosis ] in stats/diagnosis.py for what the figures mean and how the advice
is chosen.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from fastloader.stats.diagnosis import INPUT_BOUND_THRESHOLD, next_step


@dataclasses.dataclass
class EpochStats:
    """Timings of one epoch.

    Attributes:
        epoch: the epoch number.
        batches: batches handed to the consumer.
        samples: samples in those batches (the size of each batch's first tensor).
        wait_s: seconds the consumer was blocked in ``next()`` waiting for a batch (the first
            batch and the ``next()`` that ended the epoch included).
        compute_s: seconds between batches, when the consumer was busy with a batch.
        worker_startup_s: seconds spent starting worker processes for this epoch.
        first_batch_s: seconds from the epoch's start to its first batch (NaN before it).
        complete: whether the epoch ran to its end (False while running or if abandoned).
        iter_wait_s: seconds blocked inside ``iter(loader)`` (worker start-up included).
        first_batch_wait_s: the part of ``wait_s`` spent waiting for the first batch.
        device_wait_s: the part of ``wait_s`` after the first batch spent on the device copy.
        workers: worker processes loading the epoch (0: the training process loads); None
            when unknown (``timed_iter``).
        source_counts: for a ``fastloader.Mix``, a callable giving ``sources`` (None
            otherwise).
        io_note: set when the loading processes read from storage rather than the page cache
            (``_io_probe.io_verdict``): input-bound on I/O, with what to do.
        worker_busy_s: seconds the workers spent loading samples during the epoch, summed over
            workers (None when they do not report it).
        settings: the loader's ``LoaderSettings`` (stats/settings.py) when the loader gave
            them: the diagnosis then advises only what would change the numbers.
        downloads: for a dataset that downloads shards (``ShardedDataset`` of a URL), the
            epoch's ``DownloadStats`` (stats/downloads.py: waits for downloads, bytes,
            requests, hit rate), set when the epoch ends; None otherwise.
    """

    epoch: int
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    worker_startup_s: float = 0.0
    first_batch_s: float = math.nan
    complete: bool = False
    iter_wait_s: float = 0.0
    first_batch_wait_s: float = 0.0
    device_wait_s: float = 0.0
    workers: int | None = None
    worker_busy_s: float | None = None
    io_note: str | None = None
    settings: Any = None
    downloads: Any = None
    # the clock is looked up at each call, so a test can drive it (tests/test_stats.py)
    _started_at: float = dataclasses.field(default_factory=lambda: time.perf_counter(), repr=False)
    _busy: Any = dataclasses.field(default=None, repr=False)  # workers' shared array, running
    _busy_at_start: float = dataclasses.field(default=0.0, repr=False)
    _pids: tuple = dataclasses.field(default=(), repr=False)  # who loads: for _io_probe
    _io_before: Any = dataclasses.field(default=None, repr=False)
    # a Mix's samples per source delivered in this epoch, computed when asked (loader/mixing.py)
    source_counts: Any = dataclasses.field(default=None, repr=False)
    _ended_at: float | None = dataclasses.field(default=None, repr=False)
    _caches: tuple = dataclasses.field(default=(), repr=False)  # datasets with a shard cache
    _caches_before: Any = dataclasses.field(default=None, repr=False)  # their counters at start
    _keys: frozenset = dataclasses.field(default=frozenset(), repr=False)  # loading processes

    @property
    def wall_s(self) -> float:
        """Seconds from the epoch's start to its end (to now while it runs)."""
        end = self._ended_at if self._ended_at is not None else time.perf_counter()
        return end - self._started_at

    @property
    def _first_batch_excess_s(self) -> float:
        # The first batch's wait beyond a later batch's mean wait: what the epoch's start cost.
        later = self.batches - 1
        mean_later = (self.wait_s - self.first_batch_wait_s) / later if later > 0 else 0.0
        return max(0.0, self.first_batch_wait_s - max(0.0, mean_later))

    @property
    def start_wait_s(self) -> float:
        """The wait the epoch's start adds: ``iter(loader)`` (worker start-up included), and
        the first batch's wait beyond a later batch's mean wait."""
        return max(self.iter_wait_s, self.worker_startup_s) + self._first_batch_excess_s

    @property
    def worker_wait_s(self) -> float:
        """The rest of the wait in ``next()``, less the device copy: waiting for loading."""
        return max(0.0, self.wait_s - self._first_batch_excess_s - self.device_wait_s)

    @property
    def input_wait_s(self) -> float:
        """All the time the consumer was blocked on data: ``iter()``, start-up and ``next()``."""
        return self.wait_s + max(self.iter_wait_s, self.worker_startup_s)

    @property
    def wait_fraction(self) -> float:
        """The fraction of the epoch's wall time the consumer was blocked on data (0-1)."""
        wall = self.wall_s
        if wall <= 0.0:
            return 0.0
        return min(1.0, self.input_wait_s / wall)

    @property
    def wait_ms_per_batch(self) -> float:
        """Mean wait in ``next()`` per batch, in milliseconds (``iter()`` excluded)."""
        return 1000.0 * self.wait_s / self.batches if self.batches else 0.0

    @property
    def samples_per_s(self) -> float:
        """Samples per second of wall time."""
        wall = self.wall_s
        return self.samples / wall if wall > 0.0 else 0.0

    def _busy_s(self) -> float | None:
        if self._busy is not None:  # running: read the workers' counters now
            return max(0.0, float(sum(self._busy)) - self._busy_at_start)
        return self.worker_busy_s

    @property
    def worker_busy_fraction(self) -> float | None:
        """The share of the workers' time spent loading samples (0-1), or None if unknown."""
        busy = self._busy_s()
        if busy is None or not self.workers:
            return None
        wall = self.wall_s
        return min(1.0, busy / (self.workers * wall)) if wall > 0.0 else 0.0

    @property
    def input_bound(self) -> bool:
        """Whether the wait fraction is above ``INPUT_BOUND_THRESHOLD``."""
        return self.wait_fraction > INPUT_BOUND_THRESHOLD

    def next_step(self) -> str:
        """The one change the numbers support. See NOTE [ The diagnosis ] (stats/diagnosis.py)."""
        return next_step(self)

    def summary(self) -> str:
        """One line: the diagnosis, where the wait went, the next step, the numbers behind it."""
        details = [
            f"epoch {self.epoch}" + ("" if self.complete else " (incomplete)"),
            f"{self.batches} batches",
            f"{self.samples_per_s:.0f} samples/s",
        ]
        if self.worker_startup_s:
            details.append(f"worker start-up {self.worker_startup_s:.2f} s")
        if self.batches == 0:
            what = "empty epoch" if self.complete else "no batches yet"
            return f"{what}: {self.next_step()}; " + ", ".join(details)
        verdict = "input-bound" if self.input_bound else "not input-bound"
        line = (
            f"{verdict}: training waited {100 * self.wait_fraction:.0f}% of the epoch for data "
            f"({self.wait_ms_per_batch:.1f} ms/batch)"
        )
        wall = self.wall_s
        if self.input_bound and wall > 0.0:
            split = [f"epoch start {100 * self.start_wait_s / wall:.0f}%"]
            waiting_for = "loading" if self.workers == 0 else "workers"
            split.append(f"{waiting_for} {100 * self.worker_wait_s / wall:.0f}%")
            if self.device_wait_s:
                split.append(f"device copy {100 * self.device_wait_s / wall:.0f}%")
            line += " = " + " + ".join(split)
        busy = self.worker_busy_fraction
        if busy is not None:
            details.append(f"{self.workers} workers busy {100 * busy:.0f}%")
        if self.downloads is not None:
            details.append(self.downloads.summary())
        shares = self.source_shares
        if shares:
            details.append("sources " + " ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()))
        return f"{line}; next step: {self.next_step()}; " + ", ".join(details)

    @property
    def sources(self) -> dict[str, int] | None:
        """For a ``fastloader.Mix``: samples of each source in the batches handed out this
        epoch, over all ranks with ``distributed=True`` (the global order's); else None."""
        return None if self.source_counts is None else self.source_counts(self)

    @property
    def source_shares(self) -> dict[str, float] | None:
        """``sources`` as fractions of the epoch's samples (the realised proportions)."""
        counts = self.sources
        if not counts:
            return None
        total = sum(counts.values()) or 1
        return {name: count / total for name, count in counts.items()}

    def as_dict(self) -> dict[str, Any]:
        """The fields and derived numbers as a JSON-able dict (NaN becomes None)."""
        first = None if math.isnan(self.first_batch_s) else self.first_batch_s
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "samples": self.samples,
            "wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "worker_startup_s": self.worker_startup_s,
            "first_batch_s": first,
            "complete": self.complete,
            "iter_wait_s": self.iter_wait_s,
            "first_batch_wait_s": self.first_batch_wait_s,
            "device_wait_s": self.device_wait_s,
            "start_wait_s": self.start_wait_s,
            "worker_wait_s": self.worker_wait_s,
            "workers": self.workers,
            "worker_busy_s": self._busy_s(),
            "worker_busy_fraction": self.worker_busy_fraction,
            "wall_s": self.wall_s,
            "wait_fraction": self.wait_fraction,
            "wait_ms_per_batch": self.wait_ms_per_batch,
            "samples_per_s": self.samples_per_s,
            "input_bound": self.input_bound,
            "next_step": self.next_step(),
            "sources": self.sources,
            "downloads": None if self.downloads is None else self.downloads.as_dict(),
        }
