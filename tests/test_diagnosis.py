"""NOTE [ The diagnosis ]: the wait the loader reports is the wait a stopwatch sees, and the
summary names the next step its numbers support."""

import csv
import os
import time

import pytest
import torch
from torch.utils.data import Dataset

from fastloader import DataLoader
from fastloader.stats.settings import LoaderSettings
from fastloader.stats.timing import EpochStats


class SleepsPerSample(Dataset):
    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return torch.tensor([i])


class SlowToStart(SleepsPerSample):
    """Each worker's first sample takes 0.3 s (opening files, building a pipeline)."""

    def __init__(self, n: int) -> None:
        super().__init__(n, 0.0)
        self.opened = False

    def __getitem__(self, i):
        if not self.opened:
            time.sleep(0.3)
            self.opened = True
        return torch.tensor([i])


def _stopwatch_epoch(loader, step_s: float) -> float:
    """The share of an epoch spent inside iter() and next(), timed from outside the loader."""
    clock = time.perf_counter
    began = clock()
    iterator = iter(loader)
    blocked = clock() - began
    while True:
        asked = clock()
        try:
            next(iterator)
        except StopIteration:
            blocked += clock() - asked
            break
        blocked += clock() - asked
        time.sleep(step_s)
    return blocked / (clock() - began)


@pytest.mark.parametrize(
    ("num_workers", "persistent", "sample_s", "step_s"),
    [
        (2, False, 0.003, 0.004),  # data-bound, workers started inside iter() every epoch
        (2, True, 0.003, 0.004),  # data-bound, persistent workers
        (0, False, 0.002, 0.004),  # loading in the training process
        (2, True, 0.0, 0.02),  # the model is the bottleneck
    ],
)
def test_reported_wait_fraction_agrees_with_a_stopwatch(num_workers, persistent, sample_s, step_s):
    loader = DataLoader(
        SleepsPerSample(48, sample_s),
        batch_size=6,
        num_workers=num_workers,
        persistent_workers=persistent,
    )
    with loader:
        for _ in range(2):
            expected = _stopwatch_epoch(loader, step_s)
            reported = loader.stats.last
            assert reported.complete and reported.batches == 8
            # The loader's clock starts and stops a few microseconds inside the stopwatch's:
            # both measure the same interval, so they agree on a loaded machine too.
            assert reported.wait_fraction == pytest.approx(expected, abs=0.04)
            assert reported.workers == num_workers


def test_workers_report_the_time_they_spend_loading():
    sample_s = 0.004
    loader = DataLoader(SleepsPerSample(32, sample_s), batch_size=4, num_workers=2)
    with loader:
        list(loader)
    epoch = loader.stats.last
    # every sample slept sample_s in some worker; all of it within the epoch's wall time
    assert 32 * sample_s <= epoch.worker_busy_s <= 2 * epoch.wall_s
    assert 0.0 < epoch.worker_busy_fraction <= 1.0
    assert "2 workers busy" in loader.stats.summary()


def test_an_empty_epoch_says_so():
    loader = DataLoader(SleepsPerSample(0, 0.0), batch_size=4)
    assert list(loader) == []
    summary = loader.stats.summary()
    assert summary.startswith("empty epoch: ") and "no batches" in summary
    assert "waited" not in summary


def test_an_epoch_ends_with_its_last_batch_when_its_length_is_known():
    # Lightning stops after len(loader) batches and never asks for the end of the epoch
    loader = DataLoader(SleepsPerSample(8, 0.0), batch_size=4)
    for epoch in range(2):
        iterator = iter(loader)
        next(iterator), next(iterator)
        assert loader.stats.last.epoch == epoch and loader.stats.last.complete
        assert loader.stats.current is None
    assert [e.complete for e in loader.stats.epochs] == [True, True]


def test_a_batch_beyond_the_known_length_reopens_the_epoch():
    from fastloader.stats.timing import LoaderStats

    stats = LoaderStats()
    stats.start_epoch(0)
    stats.iter_done(batches=1)
    stats.record_batch(0.0, torch.zeros(2))
    assert stats.last.complete
    stats.record_batch(0.0, torch.zeros(3))  # len() undercounted: still epoch 0
    stats.end_epoch()
    assert [(e.epoch, e.batches, e.samples, e.complete) for e in stats.epochs] == [(0, 2, 5, True)]


def _epoch(**fields) -> EpochStats:
    epoch = EpochStats(**{"epoch": 0, "batches": 10, "samples": 100, "complete": True, **fields})
    epoch._ended_at = epoch._started_at + 1.0  # a one-second epoch
    return epoch


@pytest.mark.parametrize(
    ("fields", "step"),
    [
        (dict(wait_s=0.05, workers=2, worker_busy_s=0.2), "the model is the bottleneck"),
        (dict(wait_s=0.9, workers=2, worker_busy_s=1.96), "workers are busy 98% of the time: add"),
        (dict(wait_s=0.9, workers=4, worker_busy_s=0.8), "busy only 20% of the time, yet"),
        (  # 0.05 ms a batch: cheaper to load than to hand over from a worker
            dict(
                wait_s=0.9,
                workers=2,
                worker_busy_s=0.05,
                batches=1000,
                settings=LoaderSettings(default_collate=True),
            ),
            "a batch in 0.05 ms, less than handing it to the training process costs it",
        ),
        (  # the same with a collate_fn of the user's, which busy time leaves out: no such advice
            dict(wait_s=0.9, workers=2, worker_busy_s=0.05, batches=1000),
            "busy only 2% of the time, yet",
        ),
        (dict(wait_s=0.9, workers=0), "set num_workers > 0"),
        (  # 0.12 ms a batch in the training process: workers would not help
            dict(wait_s=0.6, workers=0, batches=5000),
            "nothing to change: a batch loads in 0.12 ms in the training process",
        ),
        (dict(wait_s=0.1, iter_wait_s=0.6, workers=2, worker_busy_s=0.4), "epoch's start"),
        (dict(wait_s=0.9, device_wait_s=0.7, workers=2, worker_busy_s=0.4), "copy to the device"),
    ],
)
def test_the_next_step_follows_the_largest_part_of_the_wait(fields, step):
    epoch = _epoch(**fields)
    assert step in epoch.next_step()
    assert f"next step: {epoch.next_step()}" in epoch.summary()


def test_the_wait_is_split_into_start_workers_and_device():
    epoch = _epoch(
        wait_s=0.6,
        first_batch_wait_s=0.15,
        iter_wait_s=0.1,
        device_wait_s=0.05,
        workers=2,
        worker_busy_s=1.0,
    )
    # later batches waited 0.05 s each: the first batch's extra 0.1 s is the epoch's start
    assert epoch.start_wait_s == pytest.approx(0.2)
    assert epoch.worker_wait_s == pytest.approx(0.45)
    assert epoch.wait_fraction == pytest.approx(0.7)
    assert "= epoch start 20% + workers 45% + device copy 5%" in epoch.summary()


def test_device_copy_time_is_told_apart_from_loading():
    loader = DataLoader(SleepsPerSample(12, 0.001), batch_size=4, device="cpu")
    assert len(list(loader)) == 3
    epoch = loader.stats.last
    assert 0.0 <= epoch.device_wait_s <= epoch.wait_s
    assert epoch.worker_wait_s + epoch.device_wait_s <= epoch.wait_s + 1e-9


@pytest.mark.cuda
def test_cuda_copy_time_is_told_apart_from_loading():
    # large float batches: the copy to the GPU takes measurable time of each wait
    class Big(SleepsPerSample):
        def __getitem__(self, i):
            return torch.full((256, 1024), float(i))

    loader = DataLoader(Big(64, 0.0), batch_size=16, num_workers=2, device="cuda")
    with loader:
        for _ in range(2):
            batches = [batch.sum().item() for batch in loader]
    assert len(batches) == 4
    epoch = loader.stats.last
    assert epoch.complete and 0.0 <= epoch.device_wait_s <= epoch.wait_s
    assert epoch.start_wait_s + epoch.worker_wait_s + epoch.device_wait_s == pytest.approx(
        epoch.input_wait_s, abs=1e-6
    )


lightning = pytest.importorskip("lightning.pytorch")


class _Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(SleepsPerSample(12, 0.001), batch_size=4, num_workers=1)


@pytest.mark.lightning
def test_lightning_callback_logs_the_wait_fraction_every_epoch(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from fastloader.lightning import LoaderStatsMonitor

    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[LoaderStatsMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(_Model())
    trainer.train_dataloader.close()
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("data/wait_fraction")]
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    assert all(0.0 <= float(row["data/wait_fraction"]) <= 1.0 for row in rows)
    assert all(0.0 <= float(row["data/worker_busy"]) <= 1.0 for row in rows)


def test_loading_that_reads_from_storage_is_named_input_bound_on_io():
    """The summary tells a pack bigger than memory from slow decoding (see stats/io_probe.py)."""
    from fastloader.stats.io_probe import IOCounters, sum_counters
    from fastloader.stats.timing import LoaderStats

    stats = LoaderStats()
    stats.start_epoch(0)
    stats.watch_workers(2, None, pids=[os.getpid()])
    now = sum_counters([os.getpid()])
    if now.read_bytes is None:
        pytest.skip("/proc/<pid>/io is not readable here")
    # as if the loading processes had read 300 KB per sample from storage, CPU mostly idle
    stats._current._io_before = IOCounters(now.read_bytes - 100 * 300_000, 0, now.cpu_seconds)
    stats.iter_done()
    time.sleep(0.05)
    stats.record_batch(0.05, torch.zeros(100, 1))
    stats.end_epoch()
    summary = stats.last.summary()
    assert "input-bound on I/O" in summary and "does not fit in memory" in summary, summary


# NOTE [ Advice that changes the numbers ]: each advice the loader's settings allow, and each
# case where the advice is already followed or cannot apply.

PERSISTENT = LoaderSettings(persistent_workers=True, cpus=16)
START = dict(wait_s=0.1, iter_wait_s=0.6, workers=2, worker_busy_s=0.4)
DEVICE = dict(wait_s=0.9, device_wait_s=0.7, workers=2, worker_busy_s=0.4)
BUSY = dict(wait_s=0.9, workers=2, worker_busy_s=1.96)
IO_NOTE = "input-bound on I/O: workers read 300 KiB ...: your data does not fit in memory"


@pytest.mark.parametrize(
    ("fields", "settings", "says", "never"),
    [
        # the epoch start
        (START, None, "keep workers persistent", "nothing to change"),
        (START, LoaderSettings(persistent_workers=False), "persistent_workers=False", None),
        (
            dict(START, worker_startup_s=0.5),
            PERSISTENT,
            "nothing to change: most of the wait is starting 2 workers, once per loader",
            "keep workers persistent",
        ),
        (START, PERSISTENT, "nothing to change: in an epoch of 10 batches", "keep workers"),
        (
            dict(START, batches=100, samples=1000),
            PERSISTENT,
            "may not have been loaded ahead",
            "keep workers persistent",
        ),
        # the device step
        (DEVICE, None, "use pinned memory", None),
        (
            DEVICE,
            LoaderSettings(device_type="cpu", device_transform=True),
            "apply it in the dataset",
            "pin_memory",
        ),
        (DEVICE, LoaderSettings(device_type="cpu"), "leave device= out", "pin_memory"),
        (
            DEVICE,
            LoaderSettings(device_type="cuda", pinned=True),
            "device_transform=fastloader.Normalize",
            "pin_memory",
        ),
        (
            DEVICE,
            LoaderSettings(device_type="cuda", pinned=True, device_transform=True),
            "already from pinned memory on a side stream: send fewer bytes",
            "device_transform=",
        ),
        # busy workers
        (BUSY, LoaderSettings(cpus=16), "busy 98% of the time: add workers", None),
        (BUSY, LoaderSettings(cpus=2), "already use this machine's 2 CPUs", "add workers"),
        (BUSY, LoaderSettings(cpus=3), "already use this machine's 3 CPUs", "add workers"),
        # reads from storage
        (
            dict(BUSY, io_note=IO_NOTE),
            LoaderSettings(data_bytes=1_100_000, memory_bytes=18_000_000_000),
            "nothing to change: the data (1.1 MB) was read from storage",
            "does not fit",
        ),
        (
            dict(BUSY, io_note=IO_NOTE),
            LoaderSettings(data_bytes=3_000_000_000, memory_bytes=1_400_000_000),
            "does not fit in memory",
            "nothing to change",
        ),
        (dict(BUSY, io_note=IO_NOTE), LoaderSettings(), "does not fit in memory", None),
        # not input-bound
        (dict(wait_s=0.05, workers=2), PERSISTENT, "nothing to change: the loader keeps up", None),
    ],
)
def test_the_advice_is_only_what_would_change_the_numbers(fields, settings, says, never):
    epoch = _epoch(**fields, settings=settings)
    assert says in epoch.next_step()
    assert never is None or never not in epoch.next_step()


def test_the_loader_gives_the_diagnosis_its_settings(tmp_path):
    import fastloader

    pack = tmp_path / "data.h5"
    fastloader.pack([(torch.zeros(4, dtype=torch.uint8).numpy(), 0)] * 8, pack, progress=False)
    loader = DataLoader(fastloader.HDF5Dataset(pack), batch_size=4, num_workers=1, device="cpu")
    with loader:
        list(loader)
    settings = loader.stats.last.settings
    assert settings.persistent_workers and settings.device_type == "cpu" and not settings.pinned
    assert 0 < settings.data_bytes <= pack.stat().st_size
    assert settings.memory_bytes is None or settings.memory_bytes > 0


def test_an_epoch_that_starts_persistent_workers_is_not_told_to_keep_them():
    """A one-epoch run with persistent workers (every example's set-up) whose wait is the
    workers' start-up: nothing to change, not "keep workers persistent"."""
    loader = DataLoader(SlowToStart(8), batch_size=4, num_workers=2)
    with loader:
        list(loader)
    step = loader.stats.last.next_step()
    assert "keep workers persistent" not in step
    assert loader.stats.last.worker_startup_s > 0


def test_the_memory_for_the_page_cache_is_read_at_most_once_a_second(monkeypatch):
    """Short epochs share one reading of /proc and the cgroups (130 us each, a third of an
    epoch's start for cheap data); a reading older than a second is taken again."""
    from fastloader.stats import settings as settings_module

    readings = iter(range(1, 100))
    monkeypatch.setattr(settings_module, "memory_for_cache", lambda: next(readings) << 30)
    monkeypatch.setattr(settings_module, "_memory_read", (float("-inf"), None))
    loader = DataLoader(list(range(8)), batch_size=4)
    for _ in range(3):
        list(loader)
    assert [epoch.settings.memory_bytes for epoch in loader.stats.epochs] == [1 << 30] * 3
    read_at, _ = settings_module._memory_read
    monkeypatch.setattr(
        settings_module, "_memory_read", (read_at - settings_module.MEMORY_READ_EVERY_S, 1 << 30)
    )
    list(loader)
    assert loader.stats.epochs[-1].settings.memory_bytes == 2 << 30
