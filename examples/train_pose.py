"""Train on your own HDF5 file of images + keypoints + names: read in place, or packed.

    python examples/train_pose.py                       # a tiny generated pose.h5, CPU or CUDA
    python examples/train_pose.py --data pose.h5 --device cuda
    python examples/train_pose.py --pack pose.lmdb      # pack the file once, train from the pack

``--data`` is an HDF5 file of aligned datasets, as ``h5py``'s ``create_dataset`` writes them
(``image`` N×H×W×3 uint8, ``part`` N×14×2 float keypoints, ``imagename`` N strings); without it
a tiny one is generated. Random horizontal flips move the keypoints with the image.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn

import fastloader
from fastloader import DataLoader, HDF5Dataset, LMDBDataset

JOINTS = 14


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="an HDF5 file of aligned datasets (default: generated)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pack", help="pack the file into this .lmdb/.h5 once, train from it")
    return parser.parse_args()


def tiny_pose_file(path: Path, samples: int = 96, size: int = 32) -> Path:
    """A pose-style file: images with a bright square per joint, and the joints' positions."""
    rng = np.random.default_rng(0)
    parts = rng.uniform(2, size - 3, (samples, JOINTS, 2)).astype(np.float32)
    images = np.zeros((samples, size, size, 3), np.uint8)
    for i, joints in enumerate(parts.astype(int)):
        for x, y in joints:
            images[i, y - 1 : y + 2, x - 1 : x + 2] = 255
    partial = path.with_suffix(".partial")
    with h5py.File(partial, "w") as file:
        file.create_dataset("image", data=images)
        file.create_dataset("part", data=parts)
        file.create_dataset("imagename", data=[f"im{i:04d}.jpg".encode() for i in range(samples)])
    os.replace(partial, path)
    return path


def flip(sample: dict) -> dict:
    """Random horizontal flip of the image and its keypoints (seeded per sample by fastloader)."""
    image, part = sample["image"], sample["part"].copy()
    if random.random() < 0.5:
        image = image[:, ::-1]
        part[:, 0] = image.shape[1] - 1 - part[:, 0]
    image = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)  # uint8 CHW
    return {"image": image, "part": torch.from_numpy(part), "imagename": sample["imagename"]}


def main() -> None:
    args = parse_args()
    data = Path(args.data or tiny_pose_file(Path(tempfile.gettempdir()) / "fastloader-pose.h5"))
    if args.pack:
        if not Path(args.pack).exists():  # once: every field checksummed, the image as pixels
            fastloader.pack(data, args.pack, schema={"image": "image"}, store="raw")
        train = LMDBDataset(args.pack, decode="numpy", sample_transform=flip)  # .h5: HDF5Dataset
    else:
        train = HDF5Dataset(data, transform=flip)  # your file, read in place in each worker
    loader = DataLoader(
        train, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, seed=0
    )
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(16 * 16, JOINTS * 2),
    ).to(args.device)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with loader:
        for epoch in range(args.epochs):
            for batch in loader:  # a dict of batched fields; names as a list of str
                images = batch["image"].to(args.device).float() / 255
                target = batch["part"].to(args.device).flatten(1)
                loss = nn.functional.mse_loss(model(images), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            print(f"epoch {epoch}: loss {loss.item():.1f}; {loader.stats.summary()}")


if __name__ == "__main__":
    main()
