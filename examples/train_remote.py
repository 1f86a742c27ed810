"""Training from shards in S3 (or a folder of shards), stopped and resumed on another world size.

    python examples/train_remote.py --url s3://bucket/train --pack         # pack, then train
    torchrun --nproc-per-node 2 examples/train_remote.py --url s3://bucket/train --stop-after 3
    torchrun --nproc-per-node 3 examples/train_remote.py --url s3://bucket/train --resume

The endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``); ``--url`` may also be a folder. ``--pack``
writes a tiny generated dataset there first. ``--log-samples FILE`` writes the labels each rank
read at each step, so a test can check that the stopped and resumed runs read every sample of
the epoch exactly once. docs/remote.md says how the order, the cache and resume work.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from _torchrun import join, leave
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fastloader

SAMPLES, SIDE = 240, 8


class Tiny:
    """``SAMPLES`` small images whose label is their index (a test can follow each sample)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        pixels = np.random.default_rng(index).integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8)
        return {"image": pixels, "label": index}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="s3://bucket/prefix, or a folder")
    parser.add_argument("--pack", action="store_true", help="pack a tiny dataset to --url first")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "fl-shards"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--workers", type=int, default=1, help="per rank")
    parser.add_argument("--checkpoint", default="remote-checkpoint.pt")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (a test)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--log-samples", help="write each step's labels per rank to FILE.rankN")
    return parser.parse_args()


def build(args: argparse.Namespace, distributed: bool, rank: int) -> tuple:
    """The sharded dataset (packed first with ``--pack``), its loader, a model, an optimizer."""
    if args.pack and rank == 0:
        fastloader.pack(Tiny(), args.url, shard_size="40KB", workers=0, overwrite=True)
    if distributed:
        dist.barrier()
    ds = fastloader.ShardedDataset(args.url, cache_dir=args.cache, cache_limit="50MB", lanes=6)
    loader = fastloader.DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        distributed=distributed,
        seed=0,
    )
    model = nn.Linear(SIDE * SIDE * 3, 10)
    if distributed:
        model = DistributedDataParallel(model)
    return loader, model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    images = batch["image"].flatten(1).float() / 255
    loss = nn.functional.cross_entropy(model(images), batch["label"] % 10)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    args = parse_args()
    distributed, rank = join()  # examples/_torchrun.py: under torchrun, the gloo group
    loader, model, optimizer = build(args, distributed, rank)
    step = 0
    if args.resume:  # another world size, worker count or batch size: the state counts samples
        checkpoint = torch.load(args.checkpoint)
        model.load_state_dict(checkpoint["model"])
        loader.load_state_dict(checkpoint["loader"])
        step = checkpoint["step"]
        if rank == 0:
            print(f"resumed at step {step}, sample {checkpoint['loader']['position']}")
    log = open(f"{args.log_samples}.rank{rank}", "a") if args.log_samples else None
    for epoch in range(loader.epoch, args.epochs):
        for batch in loader:
            loss = train_step(model, optimizer, batch)
            step += 1
            if log is not None:
                log.write(json.dumps([epoch, batch["label"].tolist()]) + "\n")
            if rank == 0:
                state = {"model": model.state_dict(), "loader": loader.state_dict(), "step": step}
                torch.save(state, args.checkpoint)
            if step == args.stop_after:
                break
        else:
            if rank == 0:
                print(f"epoch {epoch}: loss {loss:.3f}, step {step}")
            continue
        if rank == 0:
            print(f"stopped after step {step}; run again with --resume")
        break
    if log is not None:
        log.close()
    loader.close()
    leave(distributed)


if __name__ == "__main__":
    main()
