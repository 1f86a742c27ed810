"""A Lightning DDP fit (2 CPU ranks) with fastloader loaders, run as a script by the tests.

Lightning's "ddp" strategy starts rank 1 by running this script again. Each rank runs a fit
with a mid-epoch checkpoint, then a second fit resumed from it, and saves what it saw to
``OUT/rank{rank}.json``. The training loader gets Lightning's injected DistributedSampler; the
validation loader has ``distributed=True`` (exactly-once evaluation, which Lightning keeps).
Usage: ``python _lightning_ddp.py OUT``.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from _datasets import RandomDraws

from fastloader import DataLoader
from fastloader.sampling.distributed import gather_in_order

CHECKPOINT_STEP = 8  # 6 steps per epoch and rank: 2 steps into epoch 1


class Recorder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen = []  # per step: [epoch, indices, worker pids]
        self.val_indices, self.val_results = [], []
        self.val_batches = []  # per validation run: batches on this rank
        self.gathered = []  # per validation run: every rank's results in dataset order

    def training_step(self, batch, batch_idx):
        values, pids = batch
        self.seen.append(
            [self.current_epoch, values[:, 0].long().tolist(), sorted(set(pids.tolist()))]
        )
        return self.layer(values.float()).mean()

    def validation_step(self, batch, batch_idx):
        values, _ = batch  # no collective here: ranks may take different numbers of steps
        self.val_indices += values[:, 0].long().tolist()
        self.val_results += (values[:, 0] * 10).tolist()

    def on_validation_epoch_end(self):
        self.val_batches.append(len(self.val_indices))
        self.gathered.append(gather_in_order(self.val_indices, self.val_results, length=17))
        self.val_indices, self.val_results = [], []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        # forkserver: a worker forked straight from a DDP rank (gloo and Lightning threads
        # running) can deadlock inside fork() itself; seen once in CI.
        return DataLoader(
            RandomDraws(48),
            batch_size=4,
            shuffle=True,
            num_workers=1,
            seed=5,
            multiprocessing_context="forkserver",
        )

    def val_dataloader(self):
        # 17 samples, 2 per rank and step: rank 0 takes 5 batches, rank 1 takes 4
        return DataLoader(RandomDraws(17), batch_size=2, distributed=True, shuffle=False)


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
        num_sanity_val_steps=0,
        **kwargs,
    )


def main(out):
    checkpoint = os.path.join(out, "mid.ckpt")
    full = Recorder()
    fit = trainer(callbacks=[CheckpointAt(checkpoint)])
    fit.fit(full, datamodule=Data())
    sampler = fit.train_dataloader.sampler
    injected = type(sampler).__name__
    val_sampler = type(fit.val_dataloaders.sampler).__name__
    resumed = Recorder()
    trainer().fit(resumed, datamodule=Data(), ckpt_path=checkpoint)
    result = {
        "full": full.seen,
        "resumed": resumed.seen,
        "sampler": injected,
        "val_sampler": val_sampler,
        "val_samples": full.val_batches,
        "gathered": full.gathered,
    }
    with open(os.path.join(out, f"rank{fit.global_rank}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1])
