"""Where the time goes: how long training waited for data, per epoch, and what to do about it.

Runs in the main (training) process, on every batch, so it is kept to two ``perf_counter``
calls and a few additions per batch. The loader calls ``LoaderStats.start_epoch`` as soon as
``iter(loader)`` is called and ``iter_done`` when it returns, times each ``next()`` and calls
``record_batch``; ``timed_iter`` does the same for any iterable. Workers add the time they
spend loading each task to a shared array (``SeededDataset.busy``), read here at the end of an
epoch. See NOTE [ The diagnosis ].

Vocabulary:
    wait: the consumer was blocked waiting for data: inside ``iter(loader)`` or ``next()``.
    epoch start: the wait inside ``iter(loader)`` (worker start-up included) and for the first
        batch of the epoch.
    device copy: the part of a ``next()`` spent issuing and awaiting the copy to the device.
    compute: the time between batches, when the consumer had a batch and was busy with it.
    busy workers: the share of the workers' time spent loading samples.

NOTE [ The diagnosis ]

A user reads one line and must know whether loading slows training and what to change. The
wait fraction counts every second the training loop was blocked on data (``iter()`` included,
the ``next()`` that ends the epoch included) over the epoch's wall time, from ``iter()`` to the
end. Below ``INPUT_BOUND_THRESHOLD`` the loader keeps up: the model is the bottleneck. Above
it, the wait is split into what the loader can tell apart and the one next step is chosen from
the largest part:

- the epoch start (worker start-up, the first batch): longer epochs, persistent workers;
- loading in the training process (``num_workers=0``): use workers;
- the device copy: pinned memory, smaller batches on the wire (uint8, not float32);
- waiting for workers while they are busy most of the time (``BUSY_WORKERS``): more workers,
  or cheaper samples (packed files, cheaper decoding and transforms);
- waiting for workers that are mostly idle: batches are slow to reach the training process
  (large Python objects pickled through the queue, an overloaded main process): return
  tensors, raise ``prefetch_factor``, or give the main process a CPU of its own.

How busy workers were is measured in the workers: each adds the seconds it spent in the
dataset for each task to its slot of a shared array (one ``perf_counter`` pair per batch);
``collate_fn`` and sending the batch are not counted. The share is those seconds over
``num_workers`` times the epoch's wall time. Iterable datasets report none.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from fastloader._batch_size import batch_size
from fastloader._io_probe import io_verdict, sum_counters

__all__ = [
    "BUSY_WORKERS",
    "EpochStats",
    "INPUT_BOUND_THRESHOLD",
    "LoaderStats",
    "batch_size",
    "timed_iter",
]

#: Training is called input-bound when it waits for data more than this fraction of an epoch.
INPUT_BOUND_THRESHOLD = 0.10
#: Workers busier than this share of their time cannot load faster: add workers.
BUSY_WORKERS = 0.80


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
        io_note: set when the loading processes read from storage rather than the page cache
            (``_io_probe.io_verdict``): input-bound on I/O, with what to do.
        worker_busy_s: seconds the workers spent loading samples during the epoch, summed over
            workers (None when they do not report it).
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
    _started_at: float = dataclasses.field(default_factory=time.perf_counter, repr=False)
    _busy: Any = dataclasses.field(default=None, repr=False)  # workers' shared array, running
    _busy_at_start: float = dataclasses.field(default=0.0, repr=False)
    _pids: tuple = dataclasses.field(default=(), repr=False)  # who loads: for _io_probe
    _io_before: Any = dataclasses.field(default=None, repr=False)
    _ended_at: float | None = dataclasses.field(default=None, repr=False)

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
        """The one change the numbers support. See NOTE [ The diagnosis ]."""
        if self.batches == 0:
            if self.complete:
                return "the epoch had no batches: is the dataset (or this rank's shard) empty?"
            return "no batch was taken from this epoch yet"
        busy = self.worker_busy_fraction
        if not self.input_bound:
            return "the loader keeps up: the model is the bottleneck, not data loading"
        if self.io_note is not None:
            return self.io_note  # the data does not fit in memory (see _io_probe.py)
        parts = {
            "start": self.start_wait_s,
            "device": self.device_wait_s,
            "workers": self.worker_wait_s,
        }
        largest = max(parts, key=parts.__getitem__)
        if largest == "start":
            return (
                "most of the wait is the epoch's start (worker start-up, first batch): keep "
                "workers persistent and the loader alive across epochs"
            )
        if largest == "device":
            return (
                "most of the wait is the copy to the device: use pinned memory "
                "(pin_memory=True) and send compact dtypes (uint8 images, normalise on device)"
            )
        if self.workers == 0:
            return "samples are loaded in the training process: set num_workers > 0"
        if busy is None:
            return "loading is slower than training: add workers or make samples cheaper"
        if busy >= BUSY_WORKERS:
            return (
                f"workers are busy {100 * busy:.0f}% of the time: add workers or make samples "
                "cheaper (pack the data, cheaper decoding and transforms)"
            )
        return (
            f"workers are busy only {100 * busy:.0f}% of the time, yet training waits: batches "
            "are slow to reach the training process (return tensors, not Python objects; "
            "raise prefetch_factor; leave the training process a CPU of its own)"
        )

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
        return f"{line}; next step: {self.next_step()}; " + ", ".join(details)

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
        }


class LoaderStats:
    """Per-epoch stats of a loader, recorded by its epoch iterator.

    The loader calls ``start_epoch`` when ``iter(loader)`` is called, ``record_worker_startup``
    if it started workers, ``watch_workers`` with the workers' shared busy-time array,
    ``iter_done`` when ``iter(loader)`` returns, ``record_batch`` after each batch is handed out
    and ``end_epoch`` when the epoch is exhausted. An epoch left early is closed, as
    incomplete, by the next ``start_epoch``.

    Attributes:
        epochs: every epoch started, oldest first (the running one last).
    """

    def __init__(self) -> None:
        self.epochs: list[EpochStats] = []
        self._current: EpochStats | None = None
        self._last_handout: float | None = None  # perf_counter when the last batch went out
        self._expected: int | None = None  # batches of the running epoch, when known
        self._closed_by_count: EpochStats | None = None  # reopened if a batch still comes

    @property
    def current(self) -> EpochStats | None:
        """The epoch being recorded, or None between epochs."""
        return self._current

    @property
    def last(self) -> EpochStats | None:
        """The last epoch that ended (complete or left early), or None."""
        for epoch in reversed(self.epochs):
            if epoch is not self._current:
                return epoch
        return None

    def start_epoch(self, epoch: int) -> None:
        """Start recording epoch ``epoch`` (closing a running one as incomplete)."""
        if self._current is not None:
            self._close(complete=False)
        self._closed_by_count = None
        self._current = EpochStats(epoch=epoch)
        self.epochs.append(self._current)
        self._last_handout = None
        self._expected = None

    def watch_workers(self, workers: int, busy: Any = None, pids: Sequence[int] = ()) -> None:
        """The current epoch is loaded by ``workers`` processes (0: the training process).

        Args:
            workers: how many worker processes load the epoch.
            busy: a shared array of the seconds each worker has spent loading (growing), or
                None if the workers do not report it.
            pids: the processes that load (for the bytes they read from storage, so that the
                diagnosis can tell a pack bigger than memory: ``_io_probe.py``).
        """
        stats = self._ensure_epoch()
        stats.workers = workers
        stats._busy = busy
        stats._busy_at_start = float(sum(busy)) if busy is not None else 0.0
        stats._pids = tuple(pids)
        stats._io_before = sum_counters(stats._pids) if stats._pids else None

    def iter_done(self, batches: int | None = None) -> None:
        """``iter(loader)`` returned: the time since ``start_epoch`` was a wait for data.

        Args:
            batches: how many batches the epoch has, when known: the epoch is then closed as
                complete when its last batch is handed out, without waiting for a ``next()``
                that may never come (Lightning stops at ``len(loader)``).
        """
        stats = self._current
        if stats is not None and stats.batches == 0:
            stats.iter_wait_s = time.perf_counter() - stats._started_at
            self._expected = batches

    def record_worker_startup(self, seconds: float) -> None:
        """Attribute ``seconds`` of worker start-up to the current epoch."""
        self._ensure_epoch().worker_startup_s += seconds

    def record_batch(
        self, wait_s: float, batch: Any, now: float | None = None, device_s: float = 0.0
    ) -> None:
        """Count one batch handed out after the consumer waited ``wait_s`` seconds for it.

        The time since the previous batch went out, less ``wait_s``, is counted as compute.

        Args:
            wait_s: seconds the consumer was blocked in ``next()`` for this batch.
            batch: the batch; its size is the length of its first tensor (or, with no tensor,
                of its first list).
            now: ``time.perf_counter()`` when the batch was handed out, if the caller has it.
            device_s: the part of ``wait_s`` spent on the copy to the device.
        """
        if now is None:
            now = time.perf_counter()
        stats = self._current
        if stats is None:
            stats = self._reopen() or self._ensure_epoch()
        previous = self._last_handout
        if not stats.batches:
            stats.first_batch_s = now - stats._started_at
            stats.first_batch_wait_s = wait_s
        else:
            if previous is not None:
                gap = now - previous - wait_s
                if gap > 0.0:
                    stats.compute_s += gap
            stats.device_wait_s += device_s
        self._last_handout = now
        stats.wait_s += wait_s
        stats.batches += 1
        stats.samples += batch_size(batch)
        if stats.batches == self._expected:
            self._close_at_last_batch(stats, now)

    def end_epoch(self, wait_s: float = 0.0) -> None:
        """Close the current epoch as complete (nothing happens between epochs).

        Args:
            wait_s: seconds spent in the final ``next()`` that found the epoch exhausted.
        """
        if self._current is not None:
            self._current.wait_s += wait_s
            self._close(complete=True, wait_s=wait_s)
        self._closed_by_count = None

    def summary(self) -> str:
        """One line about the last ended epoch (or the running one if none has ended).

        Example: ``"input-bound: training waited 41% of the epoch for data (2.1 ms/batch) =
        epoch start 3% + workers 38%; next step: workers are busy 97% of the time: add workers
        or make samples cheaper (...); epoch 3, 390 batches, 2514 samples/s, 2 workers busy
        97%"``. Input-bound means a wait fraction above ``INPUT_BOUND_THRESHOLD`` (10%); an
        epoch without batches says so. See NOTE [ The diagnosis ].
        """
        epoch = self.last or self._current
        if epoch is None:
            return "no epochs recorded yet"
        return epoch.summary()

    def as_dict(self) -> dict[str, Any]:
        """Every epoch's stats and the summary, as a JSON-able dict."""
        return {
            "input_bound_threshold": INPUT_BOUND_THRESHOLD,
            "summary": self.summary(),
            "epochs": [epoch.as_dict() for epoch in self.epochs],
        }

    def __repr__(self) -> str:
        return f"LoaderStats({len(self.epochs)} epochs: {self.summary()})"

    def _ensure_epoch(self) -> EpochStats:
        if self._current is None:
            self.start_epoch(self.epochs[-1].epoch + 1 if self.epochs else 0)
        assert self._current is not None
        return self._current

    def _close(self, complete: bool, wait_s: float = 0.0) -> None:
        stats = self._current
        assert stats is not None
        now = time.perf_counter()
        if self._last_handout is not None:
            tail = now - self._last_handout - wait_s
            if tail > 0.0:
                stats.compute_s += tail
        self._finish(stats, now, complete)

    def _close_at_last_batch(self, stats: EpochStats, now: float) -> None:
        # The last batch went out: the epoch ends when the consumer is done with it, which
        # nothing reports; a batch's mean compute time so far is the estimate.
        step = stats.compute_s / (stats.batches - 1) if stats.batches > 1 else 0.0
        stats.compute_s += step
        self._finish(stats, now + step, complete=True)
        self._closed_by_count = stats

    def _reopen(self) -> EpochStats | None:
        # A batch after the count said the epoch was over (a len() that undercounts): the
        # epoch goes on, uncounted batches are not a new epoch.
        stats, self._closed_by_count = self._closed_by_count, None
        if stats is None:
            return None
        stats.complete = False
        stats._ended_at = None
        self._current = stats
        self._last_handout = None  # the gap since the last batch is not known as compute
        return stats

    def _finish(self, stats: EpochStats, end: float, complete: bool) -> None:
        if stats._io_before is not None and stats.batches:
            delta = sum_counters(stats._pids) - stats._io_before
            wall = end - stats._started_at
            stats.io_note = io_verdict(delta, stats.samples, wall, len(stats._pids))
        stats.worker_busy_s = stats._busy_s()
        stats._busy = None
        stats._ended_at = end
        stats.complete = complete
        self._current = None
        self._last_handout = None
        self._expected = None


def timed_iter(
    iterable: Iterable[Any], stats: LoaderStats, epoch: int | None = None
) -> Iterator[Any]:
    """Iterate ``iterable`` as one epoch, recording each batch's wait into ``stats``.

    ``iter(iterable)`` is called at once; with ``epoch`` given, ``stats.start_epoch(epoch)`` is
    called first, so start-up work done by ``iter()`` counts in the epoch's wall time. The
    epoch is ended when the iterable is exhausted.

    Args:
        iterable: an epoch's batches (a DataLoader, an iterator, ...).
        stats: where to record.
        epoch: if given, start recording this epoch before ``iter(iterable)``.

    Returns:
        An iterator over the same batches.
    """
    if epoch is None:
        return _timed(iter(iterable), stats)
    stats.start_epoch(epoch)
    iterator = iter(iterable)
    stats.iter_done(epoch_length(iterable))
    return _timed(iterator, stats)


def epoch_length(iterable: Any, skip: int = 0) -> int | None:
    """The number of batches of one pass over ``iterable`` when it is known exactly: the
    ``len`` of a loader over a map-style dataset from its start, else None."""
    if skip or not isinstance(iterable, torch.utils.data.DataLoader):
        return None
    if isinstance(iterable.dataset, torch.utils.data.IterableDataset):
        return None  # torch's len() of an iterable dataset's loader is an estimate
    try:
        return len(iterable)
    except TypeError:
        return None


def _timed(iterator: Iterator[Any], stats: LoaderStats) -> Iterator[Any]:
    clock = time.perf_counter
    record = stats.record_batch
    while True:
        started = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            stats.end_epoch(clock() - started)
            return
        now = clock()
        record(now - started, batch, now)
        yield batch
