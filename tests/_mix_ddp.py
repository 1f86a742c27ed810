"""Runs in each forked rank of the mix's distributed tests (gloo on CPU)."""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist
from _mix_sources import EQUAL, SIXTEEN, WEIGHTS, Numbered

from fastloader import DataLoader, Mix
from fastloader.sampling.distributed import gather_in_order

SEED = 5
EPOCH = 1


def mix(schedule=None) -> Mix:
    """The 16 sources of the order tests, as real datasets; two epochs of the largest."""
    sources = {name: Numbered(n) for name, n in SIXTEEN.items()}
    return Mix(sources, WEIGHTS, schedule=schedule, samples_per_epoch=2 * max(SIXTEEN.values()))


def rows(batch) -> list[list]:
    """[source, index, draws...] per sample of a MixSample batch."""
    return [
        [source, int(index), *values.tolist()[1:]]
        for source, index, values in zip(batch.source, batch.index, batch.sample, strict=True)
    ]


def _train(plan: dict, out: dict) -> None:
    loader = DataLoader(
        mix(plan.get("schedule")),
        batch_size=plan["batch_size"],
        distributed=True,
        shuffle=True,
        seed=SEED,
        num_workers=plan["num_workers"],
    )
    if "resume" in plan:
        with open(plan["resume"]) as file:
            loader.load_state_dict(json.load(file))
    else:
        loader.set_epoch(EPOCH)
    taken = []
    for step, batch in enumerate(loader):
        if step == plan.get("change_at_step"):
            out["changed_at"] = loader.dataset.set_weights(EQUAL)
        if step == plan.get("save_at_step"):
            out["state"] = loader.state_dict()
        taken.append(rows(batch))
        if len(taken) == plan["steps"]:
            break
    out["steps"] = taken
    loader.close()


def _evaluate(plan: dict, out: dict) -> None:
    sizes = plan["eval"]
    sources = {name: Numbered(n) for name, n in sizes.items()}
    evaluation = Mix(sources, policy="once", shuffle=False)
    loader = DataLoader(evaluation, batch_size=7, distributed=True, shuffle=False)
    codes, results = [], []
    for batch in loader:
        offsets = {name: evaluation.order.offsets[evaluation.order.index[name]] for name in sizes}
        codes += [int(offsets[s]) + int(i) for s, i in zip(batch.source, batch.index, strict=True)]
        results += [f"{s}:{int(i)}" for s, i in zip(batch.source, batch.index, strict=True)]
    out["eval"] = gather_in_order(codes, results, length=sum(sizes.values()))


def run_rank(rank: int, world_size: int, init_file: str, out_dir: str, plan: dict) -> None:
    """Run ``plan`` on this rank; save what it saw to ``out_dir/rank{rank}.pt``."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    out: dict = {}
    try:
        if "steps" in plan:
            _train(plan, out)
        if "eval" in plan:
            _evaluate(plan, out)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
