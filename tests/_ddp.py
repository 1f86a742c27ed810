"""Runs in each spawned rank of the distributed tests (gloo on CPU)."""

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _datasets import RandomDraws

from fastloader import DataLoader
from fastloader.sampling.distributed import gather_in_order

SEED = 7


def train_loader(n: int, batch_size: int, num_workers: int = 0) -> DataLoader:
    return DataLoader(
        RandomDraws(n),
        batch_size=batch_size,
        shuffle=True,
        distributed=True,
        seed=SEED,
        num_workers=num_workers,
    )


def _rows(loader, batches=None):
    """Each batch as a list of rows [index, numpy, random, torch draws]."""
    taken = []
    for values, _ in loader:
        # loader.last_indices names this rank's samples (NOTE [ Indices of a batch ])
        assert loader.last_indices == values[:, 0].long().tolist(), loader.last_indices
        taken.append(values.tolist())
        if batches is not None and len(taken) == batches:
            break
    return taken


def run_rank(rank: int, world_size: int, init_file: str, out_dir: str, plan: dict) -> None:
    """Run ``plan`` on this rank and save what it saw to ``out_dir/rank{rank}.pt``.

    plan keys (all optional): ``n`` and ``batch_size`` of the training loader;
    ``resume`` (a state file: load it and take the rest of that epoch); ``epochs`` (whole
    epochs to take from a fresh loader); ``interrupt`` ([epoch, steps]: take that many
    steps of that epoch, then save the state); ``eval`` (a dataset length for
    exactly-once evaluation with ``shuffle=False``).
    """
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),  # a rank that dies fails the others, not a hang
    )
    out = {}
    try:
        n, batch_size = plan.get("n", 0), plan.get("batch_size", 1)
        workers = plan.get("num_workers", 0)
        if "resume" in plan:
            with open(plan["resume"]) as file:
                state = json.load(file)
            loader = train_loader(n, batch_size, workers)
            loader.load_state_dict(state)
            out["resumed"] = _rows(loader)
            out["resumed_epoch"] = loader.epoch
            loader.close()
        if "epochs" in plan:
            loader = train_loader(n, batch_size, workers)
            out["epochs"] = [_rows(loader) for _ in range(plan["epochs"])]
            out["worker_pids"] = loader.worker_pids
            loader.close()
        if "interrupt" in plan:
            epoch, steps = plan["interrupt"]
            loader = train_loader(n, batch_size, workers)
            loader.set_epoch(epoch)
            out["partial"] = _rows(loader, batches=steps)
            out["state"] = loader.state_dict()
            loader.close()
        if "eval" in plan:
            loader = DataLoader(
                RandomDraws(plan["eval"]), batch_size=2, distributed=True, shuffle=False
            )
            indices, results = [], []
            batches = 0
            for values, _ in loader:  # no collective inside the loop: counts may differ
                batches += 1
                indices += values[:, 0].long().tolist()
                results += (values[:, 0] * 10).tolist()
            out["eval_batches"] = batches
            out["eval"] = gather_in_order(indices, results, length=plan["eval"])
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(run: object, out: Path, world_size: int, plan: dict) -> list:
    """Run ``run(rank, world_size, init_file, out_dir, plan)`` on ``world_size`` forked ranks;
    return what each rank saved to ``out/rank{rank}.pt``.

    Forked, not spawned: a spawned rank re-imports torch (~10 s each on a busy 2-core box).
    Gloo's TCP mesh on loopback now and then fails to connect (seen once in CI: "connectFullMesh
    failed ... Connection closed by peer", before any rank ran a step); that set-up, and
    nothing else, is tried once more with a fresh rendezvous file.
    """
    out.mkdir()
    for attempt in range(2):
        try:
            mp.start_processes(
                run,
                args=(world_size, str(out / f"init{attempt}"), str(out), plan),
                nprocs=world_size,
                join=True,
                start_method="fork",
            )
            break
        except mp.ProcessRaisedException as error:
            if attempt or "connectFullMesh" not in str(error):
                raise
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]
