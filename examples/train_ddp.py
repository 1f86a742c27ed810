"""Distributed training with torchrun: one global order, elastic resume, exactly-once eval.

    torchrun --nproc-per-node 2 examples/train_ddp.py                  # CPU (gloo), tiny data
    torchrun --nproc-per-node 8 examples/train_ddp.py --data train/ --device cuda
    torchrun --nproc-per-node 2 examples/train_ddp.py --stop-after 2   # "preempted" ...
    torchrun --nproc-per-node 3 examples/train_ddp.py --resume         # ... on another size

``--data`` is a folder in torchvision ``ImageFolder`` layout on every node (same path, same
files); without it a tiny one is generated (``_tiny_data.py``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from fastloader import DataLoader, ImageFolder
from fastloader import transforms as T
from fastloader.distributed import gather_in_order


class WithIndex(Dataset):
    """``(image, label, index)``: evaluation results can be put back in dataset order."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple:
        return (*self.dataset[index], index)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="an image folder (default: tiny generated data)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--workers", type=int, default=1, help="per rank")
    parser.add_argument("--crop", type=int, default=64)
    parser.add_argument(
        "--checkpoint", default=os.path.join(tempfile.gettempdir(), "fastloader-ddp-checkpoint.pt")
    )
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (a test)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, ...
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if args.data is None:
        from _tiny_data import DEFAULT_ROOT, make_image_folder  # examples/_tiny_data.py

        if rank == 0:
            make_image_folder(DEFAULT_ROOT)
        dist.barrier()  # every rank must see the same files
        args.data = DEFAULT_ROOT

    train_set = ImageFolder(args.data, transform=T.Compose(
        [T.RandomResizedCrop(args.crop), T.RandomHorizontalFlip(), T.PILToTensor()]))  # fmt: skip
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,  # per rank: a step takes batch_size x world_size samples
        shuffle=True,
        num_workers=args.workers,
        distributed=True,  # one order of the whole dataset from (seed, epoch), split by rank
        drop_last=True,
        seed=0,  # the same on every rank
        device=device,
    )
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, len(train_set.classes)),
    ).to(device)  # fmt: skip
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    step = 0
    if args.resume:  # any world size: the state counts global samples
        checkpoint = torch.load(args.checkpoint, map_location=device)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])  # every rank loads the same state
        step = checkpoint["step"]
        if rank == 0:
            position = checkpoint["loader"]["position"]
            print(f"resumed at step {step}: epoch {loader.epoch}, global sample {position}")
    for epoch in range(loader.epoch, args.epochs):
        loss = None  # a resumed epoch may have no full batch left for this world size
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images.float() / 255), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:  # one rank's state resumes every rank of any new world size
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "loader": loader.state_dict(), "step": step}, args.checkpoint)
            if step == args.stop_after:
                if rank == 0:
                    print(f"stopped after step {step}; run again with --resume")
                loader.close()
                dist.barrier()  # every rank done with gloo before any tears it down (see README)
                dist.destroy_process_group()
                return
        if rank == 0:
            done = "no batch left" if loss is None else f"loss {loss.item():.3f}"
            print(f"epoch {epoch}: {done}, step {step}")
    loader.close()

    # Exactly-once evaluation: every sample on exactly one rank, no padding.
    val_set = WithIndex(ImageFolder(args.data, transform=T.Compose(
        [T.Resize(args.crop), T.CenterCrop(args.crop), T.PILToTensor()])))  # fmt: skip
    val = DataLoader(val_set, batch_size=args.batch_size, distributed=True, shuffle=False)
    indices, predictions = [], []
    with torch.no_grad():  # no collective per step: ranks may take different numbers of steps
        for images, _labels, index in val:
            indices += index.tolist()
            predictions += model.module(images.to(device).float() / 255).argmax(1).tolist()
    all_predictions = gather_in_order(indices, predictions, length=len(val_set))  # every rank
    if rank == 0:
        correct = sum(
            p == t for p, t in zip(all_predictions, train_set.targets.tolist(), strict=True)
        )
        print(f"evaluated {len(all_predictions)} samples once each: {correct} correct")
    dist.barrier()  # every rank done with gloo before any tears it down (see README)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
