"""fastloader.lightning.PackedDataModule: packs to Lightning loaders with no boilerplate."""

import os

import numpy as np
import pytest
import torch

from fastloader import DataLoader, PackError
from fastloader.formats import RecordKind, encode_record, open_writer

lightning = pytest.importorskip("lightning.pytorch")
from _lightning import LinearModule, cpu_trainer  # noqa: E402

from fastloader.lightning import PackedDataModule  # noqa: E402

pytestmark = pytest.mark.lightning


def _write_pack(path, count: int) -> None:
    with open_writer(path, "lmdb", store="raw", classes=["a", "b"]) as writer:
        for index in range(count):
            pixels = np.full((4, 4, 3), index, dtype=np.uint8)
            writer.append(encode_record(pixels, index % 2, RecordKind.RAW), index % 2)


def _value_and_pid(image: torch.Tensor) -> tuple[int, int]:
    return int(image[0, 0, 0]), os.getpid()


class _RecordingModule(LinearModule):
    def __init__(self):
        super().__init__(1)
        self.seen = {"train": {}, "val": {}}
        self.pids = {"train": set(), "val": set()}

    def _record(self, split, batch):
        (values, pids), _labels = batch
        self.seen[split].setdefault(self.current_epoch, []).extend(values.tolist())
        self.pids[split].update(pids.tolist())
        return self.layer(values.float()[:, None]).mean()

    def training_step(self, batch, batch_idx):
        return self._record("train", batch)

    def validation_step(self, batch, batch_idx):
        self._record("val", batch)


def test_fit_reads_every_sample_each_epoch_with_workers_started_once(tmp_path):
    _write_pack(tmp_path / "train.lmdb", 12)
    _write_pack(tmp_path / "val.lmdb", 6)
    data = PackedDataModule(
        tmp_path / "train.lmdb",
        val=tmp_path / "val.lmdb",
        batch_size=4,
        num_workers=1,
        decode="tensor",
        train_transform=_value_and_pid,
        eval_transform=_value_and_pid,
        seed=5,
    )
    model = _RecordingModule()
    cpu_trainer(max_epochs=3, num_sanity_val_steps=0).fit(model, datamodule=data)
    for epoch in range(3):
        assert sorted(model.seen["train"][epoch]) == list(range(12))
        assert sorted(model.seen["val"][epoch]) == list(range(6))
    assert model.seen["train"][0] != model.seen["train"][1]  # reshuffled per epoch
    assert len(model.pids["train"]) == 1 and len(model.pids["val"]) == 1
    assert model.pids["train"] != model.pids["val"]
    assert data.classes == ["a", "b"]
    assert data._loaders == {}  # teardown closed them


def test_loaders_are_fastloader_loaders_with_the_given_options(tmp_path):
    _write_pack(tmp_path / "train.lmdb", 8)
    data = PackedDataModule(tmp_path / "train.lmdb", batch_size=2, num_workers=0, drop_last=True)
    loader = data.train_dataloader()
    assert type(loader) is DataLoader and loader is data.train_dataloader()
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (2, True, 0)
    with pytest.raises(ValueError, match="no val pack"):
        data.val_dataloader()


def test_bad_paths_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        PackedDataModule()
    with pytest.raises(FileNotFoundError, match="missing.lmdb"):
        PackedDataModule(tmp_path / "missing.lmdb")
    (tmp_path / "junk.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"0" * 100)
    with pytest.raises(PackError, match="junk.h5"):
        PackedDataModule(tmp_path / "junk.h5")
