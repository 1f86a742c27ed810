"""A Mix inside a LightningDataModule: trained, checkpointed mid-epoch, resumed exactly, and its
realised source shares logged by LoaderStatsMonitor."""

import pytest
from _mix_sources import Numbered

from fastloader import DataLoader, Mix
from fastloader.lightning import LoaderStatsMonitor

lightning = pytest.importorskip("lightning.pytorch")
from _lightning import CheckpointAt, LinearModule, cpu_trainer  # noqa: E402

pytestmark = pytest.mark.lightning


class _Module(LinearModule):
    def __init__(self):
        super().__init__(4)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(list(zip(batch.source, batch.index.tolist(), strict=True)))
        return self.layer(batch.sample.float()).mean()


class _Data(lightning.LightningDataModule):
    def train_dataloader(self):
        mix = Mix(
            {"web": Numbered(40), "code": Numbered(20), "math": Numbered(8)},
            {"web": 0.5, "code": 0.25, "math": 0.25},
            schedule={30: {"web": 0.0, "code": 0.5, "math": 0.5}},
            samples_per_epoch=48,
        )
        return DataLoader(mix, batch_size=4, num_workers=1, seed=5)


def test_a_mix_in_a_datamodule_resumes_mid_epoch_and_logs_source_shares(tmp_path):
    checkpoint = tmp_path / "mid.ckpt"
    full = _Module()
    callbacks = [CheckpointAt(15, checkpoint), LoaderStatsMonitor()]
    trainer = cpu_trainer(max_epochs=2, callbacks=callbacks)
    trainer.fit(full, datamodule=_Data())  # 12 batches an epoch: 3 batches into epoch 1
    assert len(full.seen) == 24
    shares = {k: v.item() for k, v in trainer.callback_metrics.items() if "source_share" in k}
    assert set(shares) == {f"data/source_share/{name}" for name in ("web", "code", "math")}
    # the last epoch (samples 48-95) is after the scheduled change at sample 30
    assert shares["data/source_share/web"] == 0.0
    assert shares["data/source_share/code"] == pytest.approx(0.5)
    resumed = _Module()
    cpu_trainer(max_epochs=2).fit(resumed, datamodule=_Data(), ckpt_path=checkpoint)
    assert resumed.seen == full.seen[15:]
