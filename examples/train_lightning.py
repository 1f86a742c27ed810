"""Train with Lightning: a DataModule of fastloader DataLoaders, or PackedDataModule over packs.

Needs the `lightning` extra: ``pip install -e ".[lightning]"`` from a checkout.

    python examples/train_lightning.py                 # your own DataModule, tiny data
    python examples/train_lightning.py --packed        # PackedDataModule over LMDB packs
    python examples/train_lightning.py --data train/ --device gpu --devices 8 --strategy ddp

``--data`` is a folder in torchvision ``ImageFolder`` layout; without it a tiny one is
generated (``_tiny_data.py``) and used for both training and validation.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch import nn

import fastloader
from fastloader import DataLoader, ImageFolder
from fastloader import transforms as T
from fastloader.lightning import PackedDataModule


def augment(crop: int) -> T.Compose:
    return T.Compose([T.RandomResizedCrop(crop), T.RandomHorizontalFlip(), T.PILToTensor()])


def center_crop(crop: int) -> T.Compose:
    return T.Compose([T.Resize(crop * 8 // 7), T.CenterCrop(crop), T.PILToTensor()])


class ImageData(L.LightningDataModule):
    """A DataModule that returns fastloader DataLoaders; nothing else changes."""

    def __init__(self, train: str, val: str, batch_size: int, num_workers: int, crop: int):
        super().__init__()
        self.train, self.val, self.crop = train, val, crop
        self.batch_size, self.num_workers = batch_size, num_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            ImageFolder(self.train, transform=augment(self.crop)),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            ImageFolder(self.val, transform=center_crop(self.crop)),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
        )


class TinyClassifier(L.LightningModule):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(16, classes),
        )  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.float() / 255)  # uint8 batches; normalise on the device

    def training_step(self, batch: tuple, index: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple, index: int) -> None:
        images, labels = batch
        self.log("val_accuracy", (self(images).argmax(1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="an image folder (default: tiny generated data)")
    parser.add_argument("--val", help="a validation image folder (default: --data)")
    parser.add_argument("--packed", action="store_true", help="pack the folders, use packs")
    parser.add_argument("--device", default="auto", help="Lightning's accelerator: cpu, gpu, auto")
    parser.add_argument("--devices", default="1")
    parser.add_argument("--strategy", default="auto", help="auto, ddp, ...")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--crop", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.data is None:
        from _tiny_data import make_image_folder  # examples/_tiny_data.py

        args.data = make_image_folder()
    args.val = args.val or args.data
    classes = len(ImageFolder(args.data).classes)

    if args.packed:
        packs = Path(tempfile.mkdtemp(prefix="fastloader-packs-"))  # your own path, in practice
        fastloader.pack(args.data, packs / "train.lmdb", progress=False)
        fastloader.pack(args.val, packs / "val.lmdb", progress=False)
        data = PackedDataModule(
            packs / "train.lmdb",
            val=packs / "val.lmdb",
            batch_size=args.batch_size,
            num_workers=args.workers,
            train_transform=augment(args.crop),
            eval_transform=center_crop(args.crop),
        )
    else:
        data = ImageData(args.data, args.val, args.batch_size, args.workers, args.crop)

    L.seed_everything(0)  # the same seed, so the same augmentations, every run
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator=args.device,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        strategy=args.strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(TinyClassifier(classes), datamodule=data)
    print(f"done: {trainer.current_epoch} epochs, metrics {trainer.callback_metrics}")


if __name__ == "__main__":
    main()
