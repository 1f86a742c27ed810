"""fastloader.DataLoader inside Lightning: workers persist, Lightning can rebuild the loader."""

import pytest
import torch
from _datasets import RandomDraws

from fastloader import DataLoader

lightning = pytest.importorskip("lightning.pytorch")
from _lightning import CheckpointAt, LinearModule, cpu_trainer  # noqa: E402

pytestmark = pytest.mark.lightning


class _PidModule(LinearModule):
    def __init__(self):
        super().__init__(4)
        self.train_pids, self.val_pids = {}, {}

    def _record(self, store, batch):
        values, pids = batch
        store.setdefault(self.current_epoch, set()).update(pids.tolist())
        return self.layer(values.float()).mean()

    def training_step(self, batch, batch_idx):
        return self._record(self.train_pids, batch)

    def validation_step(self, batch, batch_idx):
        self._record(self.val_pids, batch)


class _DataModule(lightning.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(RandomDraws(16), batch_size=4, shuffle=True, num_workers=1, seed=3)

    def val_dataloader(self):
        return DataLoader(RandomDraws(8), batch_size=4, num_workers=1)


def test_fit_with_validation_starts_train_and_val_workers_once():
    model = _PidModule()
    cpu_trainer(max_epochs=3).fit(model, datamodule=_DataModule())
    assert sorted(model.train_pids) == [0, 1, 2]
    train = set().union(*model.train_pids.values())
    val = set().union(*model.val_pids.values())
    assert len(train) == 1 and len(val) == 1 and train != val


def test_lightning_rebuilds_it_with_an_injected_distributed_sampler():
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    loader = DataLoader(
        RandomDraws(16), batch_size=4, shuffle=True, num_workers=1, seed=9, device_prefetch=3
    )
    sampler = torch.utils.data.DistributedSampler(loader.dataset, num_replicas=2, rank=1)
    rebuilt = _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    assert type(rebuilt) is DataLoader
    assert rebuilt.sampler is sampler
    assert (rebuilt.seed, rebuilt.device_prefetch, rebuilt.num_workers) == (9, 3, 1)
    assert rebuilt.persistent_workers is True
    expected = sorted(sampler)  # epoch 0 of rank 1
    indices = sorted(int(i) for values, _ in rebuilt for i in values[:, 0])
    assert indices == expected and len(indices) == 8
    rebuilt.close()


class _IndexModule(LinearModule):
    def __init__(self):
        super().__init__(4)
        self.seen = []

    def training_step(self, batch, batch_idx):
        values, _ = batch
        self.seen.append(values[:, 0].long().tolist())
        return self.layer(values.float()).mean()


class _ResumableData(lightning.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(RandomDraws(24), batch_size=4, shuffle=True, num_workers=1, seed=5)


def test_lightning_resume_from_mid_epoch_checkpoint_sees_the_remaining_samples(tmp_path):
    checkpoint = tmp_path / "mid.ckpt"
    full = _IndexModule()
    cpu_trainer(max_epochs=2, callbacks=[CheckpointAt(8, checkpoint)]).fit(
        full, datamodule=_ResumableData()
    )  # 6 batches per epoch: the checkpoint is 2 batches into epoch 1
    resumed = _IndexModule()
    cpu_trainer(max_epochs=2).fit(resumed, datamodule=_ResumableData(), ckpt_path=checkpoint)
    assert len(full.seen) == 12
    assert resumed.seen == full.seen[8:]
