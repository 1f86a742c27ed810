"""LoaderStatsMonitor in a Lightning fit over a sharded pack: each epoch's download figures
(NOTE [ Download stats ] in stats/downloads.py) logged for a pack in S3 (the `s3` fixture,
tests/conftest.py), with the advice in the verbose line; a folder of shards logs what any local
dataset logs."""

from __future__ import annotations

import csv
import logging

import pytest

from fastloader import DataLoader, ShardedDataset, ShardOrderSampler, pack
from tests._fields import Indexed
from tests.conftest import S3_BUCKET

lightning = pytest.importorskip("lightning.pytorch")
from _lightning import LinearModule, cpu_trainer  # noqa: E402

pytestmark = pytest.mark.lightning

SAMPLES, SIDE, BATCH = 240, 6, 20
LOCAL_FIGURES = {"data/wait_fraction", "data/samples_per_s"}  # what a local dataset logs


class _Module(LinearModule):
    def __init__(self, dataset) -> None:
        super().__init__(SIDE * SIDE)
        self.dataset = dataset

    def training_step(self, batch, batch_idx):
        return self.layer(batch["x"].flatten(1).float()).mean()

    def train_dataloader(self):
        sampler = ShardOrderSampler(self.dataset, BATCH, 1, 0, seed=5)
        return DataLoader(self.dataset, batch_size=BATCH, sampler=sampler, num_workers=0)


def _fit(dataset, tmp_path, verbose=False, **trainer) -> list[dict[str, float]]:
    """Two epochs with the monitor; the figures it logged each epoch (``data/`` only)."""
    from lightning.pytorch.loggers import CSVLogger

    from fastloader.lightning import LoaderStatsMonitor

    trainer = cpu_trainer(
        max_epochs=2,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[LoaderStatsMonitor(verbose=verbose)],
        log_every_n_steps=1,
        **trainer,
    )
    trainer.fit(_Module(dataset))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("data/wait_fraction")]
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    return [{k: float(v) for k, v in row.items() if k.startswith("data/") and v} for row in rows]


@pytest.mark.slow
def test_the_monitor_logs_each_epochs_downloads_and_the_advice(s3, tmp_path, caplog):
    from benchmarks._fault_proxy import FaultProxy

    url = f"s3://{S3_BUCKET}/lightning"
    pack(Indexed(SAMPLES, side=SIDE), url, shard_size="32KB", workers=0)
    proxy = FaultProxy(s3.endpoint)
    try:  # ahead=0 through a server 0.2 s slow per GET: the reader waits for each shard
        dataset = ShardedDataset(
            url, cache_dir=tmp_path / "cache", endpoint_url=proxy.endpoint, ahead=0
        )
        shards = len(dataset.manifest.shards)
        proxy.add("stall", count=shards, match="shard-", argument=0.2)
        with caplog.at_level(logging.INFO):
            first, second = _fit(dataset, tmp_path, verbose=True)
    finally:
        proxy.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastloader")]
    downloaded = {"shards", "bytes", "requests", "evictions", "bytes_per_s", "requests_per_s"}
    named = {f"data/downloads/{name}" for name in downloaded | {"wait_share", "wait_s"}}
    assert set(first) == set(second) == LOCAL_FIGURES | named | {"data/downloads/hit_rate"}
    # the first epoch fetches every shard once, one GET each, and its reader waits for them
    assert first["data/downloads/shards"] == first["data/downloads/requests"] == shards
    assert first["data/downloads/bytes"] == dataset.manifest.size_bytes > 0
    assert first["data/downloads/bytes_per_s"] > 0 and first["data/downloads/evictions"] == 0
    assert first["data/downloads/wait_s"] >= 0.2
    assert 0.1 <= first["data/downloads/wait_share"] <= 1.0
    assert 0.0 <= first["data/downloads/hit_rate"] < 1.0
    # the second reads them from the cache: nothing fetched, nothing waited for
    assert all(second[f"data/downloads/{name}"] == 0 for name in downloaded)
    assert second["data/downloads/wait_share"] == 0 and second["data/downloads/hit_rate"] == 1
    # the verbose line of each epoch: its downloads, and for the first, what to change
    assert len(lines) == 2 and all("downloads" in line for line in lines)
    assert f"downloads {shards} shards" in lines[0] and "--shard-size" in lines[0]
    assert "downloads 0 shards" in lines[1] and "--shard-size" not in lines[1]


@pytest.mark.slow
def test_epochs_cut_short_by_limit_train_batches_log_their_downloads(s3, tmp_path, caplog):
    # Lightning leaves such an epoch running (it never asks the loader for the next batch),
    # so its downloads are counted until the moment the monitor logs them
    url = f"s3://{S3_BUCKET}/lightning-limited"
    pack(Indexed(2_000, side=SIDE), url, shard_size="32KB", workers=0)
    dataset = ShardedDataset(url, cache_dir=tmp_path / "cache", ahead=0)
    with caplog.at_level(logging.INFO):
        first, second = _fit(dataset, tmp_path, verbose=True, limit_train_batches=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastloader")]
    names = {shard.name for shard in dataset.manifest.shards}
    cached = [path for path in (tmp_path / "cache").rglob("*") if path.name in names]
    downloaded = {"shards", "bytes", "requests", "wait_s", "wait_share", "hit_rate"}
    for epoch in (first, second):  # before: no downloads/ figures at all
        assert {f"data/downloads/{name}" for name in downloaded} <= set(epoch)
    # the first epoch's two batches needed shards that were not there: fetched, in few GETs
    assert 0 < first["data/downloads/shards"] <= first["data/downloads/requests"]
    assert first["data/downloads/bytes"] > 0 and first["data/downloads/hit_rate"] < 1
    assert first["data/downloads/shards"] + second["data/downloads/shards"] <= len(cached)
    assert len(cached) < len(names)  # two batches an epoch: not the whole pack
    assert len(lines) == 2 and all("downloads" in line for line in lines)


def test_a_folder_of_shards_logs_no_download_figures(tmp_path):
    folder = tmp_path / "shards"
    pack(Indexed(SAMPLES, side=SIDE), folder, shard_size="32KB", workers=0)
    for epoch in _fit(ShardedDataset(folder), tmp_path):
        assert set(epoch) == LOCAL_FIGURES  # as before download figures: no downloads/ keys
