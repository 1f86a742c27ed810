"""Train on an image folder with plain PyTorch: fused transforms, a pack, mid-epoch resume.

    python examples/train_folder.py                      # tiny generated data, CPU or CUDA
    python examples/train_folder.py --data train/ --device cuda --epochs 90 --batch-size 256
    python examples/train_folder.py --pack train.lmdb    # pack the folder once, train from it
    python examples/train_folder.py --stop-after 4       # "preempted" after 4 steps ...
    python examples/train_folder.py --resume             # ... continues at the next sample

``--data`` is a folder in torchvision ``ImageFolder`` layout (``DATA/<class>/<image>``);
without it a tiny one is generated (``_tiny_data.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import fastloader
from fastloader import DataLoader, ImageFolder, LMDBDataset
from fastloader import transforms as T
from fastloader.transforms import Normalize


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="an image folder (default: tiny generated data)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", default="2", help='an int, or "auto"')
    parser.add_argument("--crop", type=int, default=64, help="training crop size (ImageNet: 224)")
    parser.add_argument("--pack", help="pack the folder into this .lmdb/.h5 once, train from it")
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    parser.add_argument("--save-every", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (a test)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return parser.parse_args()


def tiny_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, classes),
    )  # fmt: skip


def save_checkpoint(path: str, model: nn.Module, optimizer, loader: DataLoader, step: int) -> None:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    torch.save({**state, "loader": loader.state_dict()}, path)  # the loader's: ~400 bytes


def load_checkpoint(path: str, model: nn.Module, optimizer, loader: DataLoader) -> int:
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    loader.load_state_dict(checkpoint["loader"])  # the next batch is the next unseen sample
    return checkpoint["step"]


def main() -> None:
    args = parse_args()
    workers = args.workers if args.workers == "auto" else int(args.workers)
    if args.data is None:
        from _tiny_data import make_image_folder  # examples/_tiny_data.py

        args.data = make_image_folder()

    # Decodes only what the random crop needs (fused with the JPEG decode); torchvision's names.
    transform = T.Compose(
        [T.RandomResizedCrop(args.crop), T.RandomHorizontalFlip(), T.PILToTensor()]
    )
    if args.pack:
        if not Path(args.pack).exists():  # once, before training (or `fastloader-pack DATA PACK`)
            fastloader.pack(args.data, args.pack, store="raw", short_side=args.crop * 8 // 7)
        train = LMDBDataset(args.pack, transform=transform)  # HDF5Dataset for a .h5 pack
    else:
        train = ImageFolder(args.data, transform=transform)  # torchvision's ImageFolder, faster
    loader = DataLoader(
        train,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=workers,  # "auto" = usable CPUs / local ranks - 1
        seed=0,  # the same order and augmentations for any num_workers, after resuming too
        drop_last=True,
        device=args.device,  # batches arrive there (on CUDA: pinned, copied on a side stream)
        device_transform=Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    )

    model = tiny_model(len(train.classes)).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    if args.resume:
        step = load_checkpoint(args.checkpoint, model, optimizer, loader)
        print(f"resumed at step {step}, epoch {loader.epoch}")

    with loader:  # stops the workers at the end (or call loader.close())
        for epoch in range(loader.epoch, args.epochs):  # loader.epoch counts epochs itself
            for images, labels in loader:  # float, normalised, on args.device
                loss = nn.functional.cross_entropy(model(images), labels.to(args.device))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if step % args.save_every == 0:
                    save_checkpoint(args.checkpoint, model, optimizer, loader, step)
                if step == args.stop_after:
                    print(f"stopped after step {step} (epoch {epoch}); run again with --resume")
                    return
            print(f"epoch {epoch}: loss {loss.item():.3f}, step {step}")
            print(loader.stats.summary())  # were we waiting for data?


if __name__ == "__main__":
    main()
