"""Where the time goes: how long training waited for data, per epoch.

Runs in the main (training) process, on every batch, so it is kept to two ``perf_counter``
calls and a few additions per batch. The loader's epoch iterator times each ``next()`` and
calls ``LoaderStats.record_batch``; ``timed_iter`` does the same for any iterable.

Vocabulary:
    wait: the consumer was blocked inside ``next()`` waiting for a batch.
    compute: the time between batches, when the consumer had a batch and was busy with it.
    worker start-up: starting worker processes at the start of the epoch (also a wait).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["EpochStats", "INPUT_BOUND_THRESHOLD", "LoaderStats", "batch_size", "timed_iter"]

#: Training is called input-bound when it waits for data more than this fraction of an epoch.
INPUT_BOUND_THRESHOLD = 0.10


@dataclasses.dataclass
class EpochStats:
    """Timings of one epoch.

    Attributes:
        epoch: the epoch number.
        batches: batches handed to the consumer.
        samples: samples in those batches (the size of each batch's first tensor).
        wait_s: seconds the consumer was blocked in ``next()`` waiting for a batch.
        compute_s: seconds between batches, when the consumer was busy with a batch.
        worker_startup_s: seconds spent starting worker processes for this epoch.
        first_batch_s: seconds from the epoch's start to its first batch (NaN before it).
        complete: whether the epoch ran to its end (False while running or if abandoned).
    """

    epoch: int
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    worker_startup_s: float = 0.0
    first_batch_s: float = math.nan
    complete: bool = False
    _started_at: float = dataclasses.field(default_factory=time.perf_counter, repr=False)
    _ended_at: float | None = dataclasses.field(default=None, repr=False)

    @property
    def wall_s(self) -> float:
        """Seconds from the epoch's start to its end (to now while it runs)."""
        end = self._ended_at if self._ended_at is not None else time.perf_counter()
        return end - self._started_at

    @property
    def input_wait_s(self) -> float:
        """All the time the consumer was blocked on data: waits plus worker start-up."""
        return self.wait_s + self.worker_startup_s

    @property
    def wait_fraction(self) -> float:
        """The fraction of the epoch's wall time the consumer was blocked on data (0-1)."""
        wall = self.wall_s
        if wall <= 0.0:
            return 0.0
        return min(1.0, self.input_wait_s / wall)

    @property
    def wait_ms_per_batch(self) -> float:
        """Mean wait in ``next()`` per batch, in milliseconds (worker start-up excluded)."""
        return 1000.0 * self.wait_s / self.batches if self.batches else 0.0

    @property
    def samples_per_s(self) -> float:
        """Samples per second of wall time."""
        wall = self.wall_s
        return self.samples / wall if wall > 0.0 else 0.0

    @property
    def input_bound(self) -> bool:
        """Whether the wait fraction is above ``INPUT_BOUND_THRESHOLD``."""
        return self.wait_fraction > INPUT_BOUND_THRESHOLD

    def summary(self) -> str:
        """One line: the diagnosis, then the numbers behind it."""
        verdict = "input-bound" if self.input_bound else "not input-bound"
        line = (
            f"{verdict}: training waited {100 * self.wait_fraction:.0f}% of the epoch for data "
            f"({self.wait_ms_per_batch:.1f} ms/batch)"
        )
        details = [
            f"epoch {self.epoch}" + ("" if self.complete else " (incomplete)"),
            f"{self.batches} batches",
            f"{self.samples_per_s:.0f} samples/s",
        ]
        if self.worker_startup_s:
            details.append(f"worker start-up {self.worker_startup_s:.2f} s")
        return f"{line}; " + ", ".join(details)

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
            "wall_s": self.wall_s,
            "wait_fraction": self.wait_fraction,
            "wait_ms_per_batch": self.wait_ms_per_batch,
            "samples_per_s": self.samples_per_s,
            "input_bound": self.input_bound,
        }


class LoaderStats:
    """Per-epoch stats of a loader, recorded by its epoch iterator.

    The loader calls ``start_epoch`` when an epoch starts, ``record_worker_startup`` if it
    started workers, ``record_batch`` after each batch is handed out and ``end_epoch`` when the
    epoch is exhausted. An epoch left early is closed, as incomplete, by the next
    ``start_epoch``.

    Attributes:
        epochs: every epoch started, oldest first (the running one last).
    """

    def __init__(self) -> None:
        self.epochs: list[EpochStats] = []
        self._current: EpochStats | None = None
        self._last_handout: float | None = None  # perf_counter when the last batch went out

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
        self._current = EpochStats(epoch=epoch)
        self.epochs.append(self._current)
        self._last_handout = None

    def record_worker_startup(self, seconds: float) -> None:
        """Attribute ``seconds`` of worker start-up to the current epoch."""
        self._ensure_epoch().worker_startup_s += seconds

    def record_batch(self, wait_s: float, batch: Any, now: float | None = None) -> None:
        """Count one batch handed out after the consumer waited ``wait_s`` seconds for it.

        The time since the previous batch went out, less ``wait_s``, is counted as compute.

        Args:
            wait_s: seconds the consumer was blocked in ``next()`` for this batch.
            batch: the batch; its size is the length of its first tensor (or, with no tensor,
                of its first list).
            now: ``time.perf_counter()`` when the batch was handed out, if the caller has it.
        """
        if now is None:
            now = time.perf_counter()
        stats = self._current if self._current is not None else self._ensure_epoch()
        previous = self._last_handout
        if previous is None:
            stats.first_batch_s = now - stats._started_at
        else:
            gap = now - previous - wait_s
            if gap > 0.0:
                stats.compute_s += gap
        self._last_handout = now
        stats.wait_s += wait_s
        stats.batches += 1
        stats.samples += batch_size(batch)

    def end_epoch(self, wait_s: float = 0.0) -> None:
        """Close the current epoch as complete (nothing happens between epochs).

        Args:
            wait_s: seconds spent in the final ``next()`` that found the epoch exhausted.
        """
        if self._current is not None:
            self._current.wait_s += wait_s
            self._close(complete=True, wait_s=wait_s)

    def summary(self) -> str:
        """One line about the last ended epoch (or the running one if none has ended).

        Example: ``"input-bound: training waited 41% of the epoch for data (2.1 ms/batch);
        epoch 3, 390 batches, 2514 samples/s"``. Input-bound means a wait fraction above
        ``INPUT_BOUND_THRESHOLD`` (10%).
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
        stats._ended_at = now
        stats.complete = complete
        self._current = None
        self._last_handout = None


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
    if epoch is not None:
        stats.start_epoch(epoch)
    return _timed(iter(iterable), stats)


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


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: its first tensor's (or array's) length, else its
    first list's.

    A 0-d tensor, or a batch with neither tensors nor lists, counts as one sample.
    """
    # Fast path for the common (images, labels) batch: this runs on every batch.
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if isinstance(first, torch.Tensor):
        shape = first.shape
        return shape[0] if shape else 1
    size = _first_tensor_len(batch)
    if size is None:
        size = _first_list_len(batch)
    return 1 if size is None else size


def _first_tensor_len(batch: Any) -> int | None:
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, (tuple, list)):
        for item in batch:
            size = _first_tensor_len(item)
            if size is not None:
                return size
    elif isinstance(batch, Mapping):
        for item in batch.values():
            size = _first_tensor_len(item)
            if size is not None:
                return size
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            size = _first_tensor_len(getattr(batch, field.name))
            if size is not None:
                return size
    return None


def _first_list_len(batch: Any) -> int | None:
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if isinstance(first, (tuple, list, Mapping)):
            return _first_list_len(first)
        return len(batch)
    if isinstance(batch, Mapping) and batch:
        return _first_list_len(next(iter(batch.values())))
    return None
