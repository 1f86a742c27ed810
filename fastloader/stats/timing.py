"""Where the time goes: how long training waited for data, per epoch, and what to do about it.

Runs in the main (training) process, on every batch, so it is kept to two ``perf_counter``
calls and a few additions per batch. The loader calls ``LoaderStats.start_epoch`` as soon as
``iter(loader)`` is called and ``iter_done`` when it returns, times each ``next()`` and calls
``record_batch``; ``timed_iter`` does the same for any iterable. Workers add the time they
spend loading each task to a shared array (``SeededDataset.busy``), read here at the end of an
epoch. See NOTE [ The diagnosis ] in stats/diagnosis.py.

Vocabulary:
    wait: the consumer was blocked waiting for data: inside ``iter(loader)`` or ``next()``.
    epoch start: the wait inside ``iter(loader)`` (worker start-up included) and for the first
        batch of the epoch.
    device copy: the part of a ``next()`` spent issuing and awaiting the copy to the device.
    compute: the time between batches, when the consumer had a batch and was busy with it.
    busy workers: the share of the workers' time spent loading samples.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from fastloader.stats.batch_size import batch_size
from fastloader.stats.diagnosis import INPUT_BOUND_THRESHOLD
from fastloader.stats.downloads import epoch_downloads, loader_keys, snapshot
from fastloader.stats.epoch import EpochStats
from fastloader.stats.io_probe import io_verdict, sum_counters


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

    def so_far(self) -> EpochStats | None:
        """A copy of the running epoch with its downloads until now (``downloads`` is
        otherwise filled when an epoch ends, and an epoch cut short, as Lightning's
        ``limit_train_batches`` does, ends only when the next one starts), or None between
        epochs. Hits and waits of other processes count as they last published them (at most
        a second old: NOTE [ Download stats ] in stats/downloads.py)."""
        stats = self._current
        if stats is None:
            return None
        running = copy.copy(stats)
        running.downloads = self._downloads(stats, time.perf_counter())
        return running

    @property
    def last(self) -> EpochStats | None:
        """The last epoch that ended (complete or left early), or None."""
        for epoch in reversed(self.epochs):
            if epoch is not self._current:
                return epoch
        return None

    def start_epoch(
        self, epoch: int, sources: Sequence[Any] = (), pids: Sequence[int] = ()
    ) -> None:
        """Start recording epoch ``epoch`` (closing a running one as incomplete).

        Args:
            epoch: the epoch number.
            sources: the datasets that download shards to a cache
                (``stats.downloads.cached_sources``): the epoch counts their downloads.
            pids: the worker processes already running (persistent workers), whose counters
                the epoch's downloads start from.
        """
        if self._current is not None:
            self._close(complete=False)
        self._closed_by_count = None
        self._current = EpochStats(epoch=epoch)
        if sources:
            self._current._caches = tuple(sources)
            self._current._keys = loader_keys(pids)
            self._current._caches_before = snapshot(sources, self._current._keys)
        self.epochs.append(self._current)
        self._last_handout = None
        self._expected = None

    def watch_workers(
        self, workers: int, busy: Any = None, pids: Sequence[int] = (), settings: Any = None
    ) -> None:
        """The current epoch is loaded by ``workers`` processes (0: the training process).

        Args:
            workers: how many worker processes load the epoch.
            busy: a shared array of the seconds each worker has spent loading (growing), or
                None if the workers do not report it.
            pids: the processes that load (for the bytes they read from storage, so that the
                diagnosis can tell a pack bigger than memory: ``stats/io_probe.py``).
            settings: the loader's ``LoaderSettings`` (``stats/settings.py``), for advice
                that would change the numbers (NOTE [ Advice that changes the numbers ]).
        """
        stats = self._ensure_epoch()
        stats.workers = workers
        stats.settings = settings
        stats._busy = busy
        stats._busy_at_start = float(sum(busy)) if busy is not None else 0.0
        stats._pids = tuple(pids)
        if stats._caches:  # workers started for this epoch: their counters from none
            stats._keys = stats._keys | loader_keys(pids)
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
        stats.downloads = self._downloads(stats, end)
        stats.worker_busy_s = stats._busy_s()
        stats._busy = None
        stats._ended_at = end
        stats.complete = complete
        self._current = None
        self._last_handout = None
        self._expected = None

    @staticmethod
    def _downloads(stats: EpochStats, end: float) -> Any:
        """The downloads of epoch ``stats`` from its start to ``end``, or None without a
        cache (NOTE [ Download stats ] in stats/downloads.py)."""
        if not stats._caches_before:
            return None
        after = snapshot(stats._caches, stats._keys)
        wall = end - stats._started_at
        return epoch_downloads(stats._caches_before, after, stats._keys, wall, stats.workers or 1)


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
