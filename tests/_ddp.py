"""Runs in each spawned rank of the distributed test."""

import torch
import torch.distributed as dist
from _datasets import RandomDraws

from fastloader import DataLoader


def _loader(n):
    return DataLoader(
        RandomDraws(n), batch_size=3, shuffle=True, distributed=True, seed=7, num_workers=1
    )


def run_rank(rank: int, world_size: int, init_file: str, out_dir: str, n: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        loader = _loader(n)
        epochs = [[v[:, 0].long().tolist() for v, _ in loader] for _ in range(2)]
        # interrupt epoch 2 after one batch, resume in a fresh loader
        iterator = iter(loader)
        partial = [next(iterator)[0][:, 0].long().tolist()]
        state = loader.state_dict()
        loader.close()
        resumed = _loader(n)
        resumed.load_state_dict(state)
        rest = [v[:, 0].long().tolist() for v, _ in resumed]
        resumed.close()
        reference = _loader(n)
        reference.set_epoch(2)
        uninterrupted = [v[:, 0].long().tolist() for v, _ in reference]
        reference.close()
        torch.save(
            {"epochs": epochs, "resumed": partial + rest, "uninterrupted": uninterrupted},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
