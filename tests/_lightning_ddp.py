"""A Lightning DDP fit (2 CPU ranks) with fastloader loaders, run as a script by the tests.

Lightning's "ddp" strategy starts rank 1 by running this script again. Each rank runs a fit
with a mid-epoch checkpoint, then a second fit resumed from it, and saves what it saw to
``OUT/rank{rank}.json``. Usage: ``python _lightning_ddp.py OUT``.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from _datasets import RandomDraws

from fastloader import DataLoader

CHECKPOINT_STEP = 8  # 6 steps per epoch and rank: 2 steps into epoch 1


class Recorder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen = []  # per step: [epoch, indices, worker pids]

    def training_step(self, batch, batch_idx):
        values, pids = batch
        self.seen.append(
            [self.current_epoch, values[:, 0].long().tolist(), sorted(set(pids.tolist()))]
        )
        return self.layer(values.float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(RandomDraws(48), batch_size=4, shuffle=True, num_workers=1, seed=5)


class CheckpointAt(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == CHECKPOINT_STEP:
            trainer.save_checkpoint(self.path)


def trainer(**kwargs):
    return pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def main(out):
    checkpoint = os.path.join(out, "mid.ckpt")
    full = Recorder()
    fit = trainer(callbacks=[CheckpointAt(checkpoint)])
    fit.fit(full, datamodule=Data())
    sampler = fit.train_dataloader.sampler
    injected = type(sampler).__name__
    resumed = Recorder()
    trainer().fit(resumed, datamodule=Data(), ckpt_path=checkpoint)
    result = {"full": full.seen, "resumed": resumed.seen, "sampler": injected}
    with open(os.path.join(out, f"rank{fit.global_rank}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1])
