"""fastloader.stats.timing: per-epoch waits, the input-bound diagnosis, the recorder's overhead."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest
import torch

from fastloader.stats.timing import INPUT_BOUND_THRESHOLD, LoaderStats, batch_size, timed_iter


def slow_batches(n: int, delay_s: float, batch_size: int = 4):
    """A data source that takes ``delay_s`` to produce each batch."""
    for i in range(n):
        time.sleep(delay_s)
        yield torch.full((batch_size, 2), i), torch.arange(batch_size)


def consume(iterator, busy_s: float) -> int:
    count = 0
    for _ in iterator:
        time.sleep(busy_s)
        count += 1
    return count


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock that only ``time.sleep`` moves: the figures are exact at any machine load."""
    now = [1000.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "sleep", sleep)
    return now


def test_slow_data_is_diagnosed_input_bound(fake_clock):
    stats = LoaderStats()
    assert consume(timed_iter(slow_batches(8, 0.03), stats, epoch=0), busy_s=0.005) == 8
    epoch = stats.last
    assert epoch is not None and epoch.complete and stats.current is None
    assert (epoch.epoch, epoch.batches, epoch.samples) == (0, 8, 32)
    assert epoch.wait_fraction == pytest.approx(0.24 / 0.28)
    assert epoch.wait_ms_per_batch == pytest.approx(30.0)
    assert epoch.compute_s == pytest.approx(0.04)
    assert stats.summary().startswith("input-bound: training waited ")
    assert "ms/batch" in stats.summary()


def test_fast_data_is_diagnosed_not_input_bound(fake_clock):
    stats = LoaderStats()
    consume(timed_iter(slow_batches(8, 0.0), stats, epoch=0), busy_s=0.03)
    epoch = stats.last
    assert epoch.wait_fraction < INPUT_BOUND_THRESHOLD
    assert epoch.wall_s == pytest.approx(epoch.compute_s + epoch.wait_s)
    assert epoch.samples_per_s == pytest.approx(32 / epoch.wall_s)
    assert stats.summary().startswith("not input-bound: training waited ")


def test_balanced_wait_fraction_is_the_share_of_time_waiting(fake_clock):
    stats = LoaderStats()
    consume(timed_iter(slow_batches(10, 0.01), stats, epoch=0), busy_s=0.03)
    # 10 ms of data per 30 ms of compute: a quarter of the time waiting.
    assert stats.last.wait_fraction == pytest.approx(0.1 / 0.4)
    assert stats.last.compute_s == pytest.approx(0.3)


def test_first_batch_time_and_worker_startup_count_as_waiting(fake_clock):
    stats = LoaderStats()
    stats.start_epoch(3)
    time.sleep(0.05)  # workers starting
    stats.record_worker_startup(0.05)
    consume(timed_iter(slow_batches(4, 0.0), stats), busy_s=0.01)
    epoch = stats.last
    assert epoch.epoch == 3 and epoch.worker_startup_s == 0.05
    assert epoch.first_batch_s == pytest.approx(0.05)
    assert epoch.wait_fraction == pytest.approx(0.05 / 0.09)  # 50 ms of start-up in 90 ms
    assert "worker start-up 0.05 s" in epoch.summary()


def test_epochs_are_recorded_separately_and_an_abandoned_one_is_incomplete():
    stats = LoaderStats()
    for epoch in range(2):
        consume(timed_iter(slow_batches(3, 0.0), stats, epoch=epoch), busy_s=0.0)
    iterator = timed_iter(slow_batches(3, 0.0), stats, epoch=2)
    next(iterator)  # the user breaks out of epoch 2
    assert stats.current.epoch == 2 and stats.last.epoch == 1
    stats.start_epoch(3)
    assert [e.epoch for e in stats.epochs] == [0, 1, 2, 3]
    assert [e.complete for e in stats.epochs] == [True, True, False, False]
    assert [e.batches for e in stats.epochs] == [3, 3, 1, 0]
    assert stats.last.epoch == 2 and "(incomplete)" in stats.summary()


def test_record_batch_without_start_epoch_starts_one():
    stats = LoaderStats()
    stats.record_batch(0.0, torch.zeros(5))
    stats.end_epoch()
    stats.record_batch(0.0, torch.zeros(2))
    assert [(e.epoch, e.samples) for e in stats.epochs] == [(0, 5), (1, 2)]


def test_end_epoch_between_epochs_does_nothing():
    stats = LoaderStats()
    stats.end_epoch()
    assert stats.epochs == [] and stats.summary() == "no epochs recorded yet"


def test_as_dict_is_json_able_including_an_epoch_without_batches():
    stats = LoaderStats()
    consume(timed_iter(slow_batches(2, 0.0), stats, epoch=0), busy_s=0.0)
    stats.start_epoch(1)
    data = json.loads(json.dumps(stats.as_dict(), allow_nan=False))
    assert data["summary"] == stats.summary()
    assert [e["batches"] for e in data["epochs"]] == [2, 0]
    assert data["epochs"][1]["first_batch_s"] is None and math.isnan(stats.current.first_batch_s)
    assert data["epochs"][0]["samples"] == 8 and data["epochs"][0]["complete"] is True


@dataclasses.dataclass
class Record:
    name: str
    pixels: torch.Tensor


@pytest.mark.parametrize(
    "batch, size",
    [
        (torch.zeros(7, 3), 7),
        ((torch.zeros(5, 3), torch.zeros(5)), 5),
        ([["a", "b"], torch.zeros(6)], 6),  # a tensor wins over an earlier list
        ({"text": ["a", "b", "c"], "ids": [1, 2, 3]}, 3),
        ({"x": {"y": torch.zeros(4)}}, 4),
        (["a", "b"], 2),
        (Record("r", torch.zeros(9)), 9),
        (np.zeros((11, 2)), 11),
        (torch.tensor(1.0), 1),
        (object(), 1),
    ],
    ids=["tensor", "tuple", "tensor-after-list", "dict-of-lists", "nested-dict", "strings",
         "dataclass", "numpy", "0d", "opaque"],
)  # fmt: skip
def test_batch_size_counts_samples(batch, size):
    assert batch_size(batch) == size


def test_recording_reads_the_clock_twice_per_batch(monkeypatch):
    """The recorder's cost per batch is two clock reads and a few additions (the module's
    promise): counted, so that it holds on a loaded machine, where a timed bound does not."""
    real, reads = time.perf_counter, [0]

    def counting() -> float:
        reads[0] += 1
        return real()

    monkeypatch.setattr(time, "perf_counter", counting)
    batch = (torch.zeros(8, 3), torch.zeros(8))
    per_epoch = []
    for batches in (100, 300):
        reads[0] = 0
        assert sum(1 for _ in timed_iter([batch] * batches, LoaderStats(), epoch=0)) == batches
        per_epoch.append(reads[0])
    assert (per_epoch[1] - per_epoch[0]) / 200 == 2
