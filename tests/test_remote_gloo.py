"""Exact elastic resume over remote shards with real gloo ranks (forked processes, one node).

4 ranks read a sharded pack from the real S3-compatible server (the `s3` fixture,
tests/conftest.py) and stop at a random step (its seed printed; set ``RESUME_SEED`` to replay
one); 3 ranks with another batch size and worker count resume from rank 0's state. The global
order is a sequence of positions (NOTE [ The shard-aware order ]): step ``k`` of a run of
``G`` samples per step holds positions ``[start + kG, start + (k+1)G)``, dealt to ranks by
lane (shards) or in rank order (``Mix``). The test rebuilds each run's position -> sample map
from what every rank read and asserts it is the uninterrupted run's, position by position:
every sample of the epoch read exactly once, and every global step the same samples.
"""

from __future__ import annotations

import json
import os
import random
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from fastloader import DataLoader, Mix, ShardedDataset, ShardOrderSampler, pack
from tests._fields import Indexed
from tests.conftest import S3_BUCKET

pytestmark = pytest.mark.slow
SEED = 11
SAMPLES, MIXED = 480, 200  # the sharded pack's samples; the mix's samples per epoch
TIMEOUT_S = 300  # a run of ranks that takes longer is killed and fails the test


class Local:
    """A local source with the remote one's fields."""

    def __len__(self) -> int:
        return 90

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full((6, 6), -i, np.int32), "y": 1000 + i}


@pytest.fixture(scope="module")
def url(s3):
    target = f"s3://{S3_BUCKET}/gloo"
    pack(Indexed(SAMPLES, side=6), target, shard_size="32KB", workers=0)  # 12 shards
    return target


def _loader(plan: dict) -> DataLoader:
    remote = ShardedDataset(plan["url"], cache_dir=plan["cache"])
    batch, workers = plan["batch"], plan["workers"]
    if plan["kind"] == "mix":
        mix = Mix(
            {"remote": remote, "local": Local()},
            {"remote": 0.7, "local": 0.3},
            samples_per_epoch=MIXED,
        )
        return DataLoader(mix, batch_size=batch, num_workers=workers, distributed=True, seed=SEED)
    sampler = ShardOrderSampler(remote, batch, seed=SEED)  # world and rank from the group
    return DataLoader(remote, batch_size=batch, num_workers=workers, sampler=sampler, seed=SEED)


def _samples(batch, kind: str) -> list:
    if kind == "mix":
        return [[s, i] for s, i in zip(batch.source, batch.index.tolist(), strict=True)]
    return [int(y) for y in batch["y"]]


def _rank(rank: int, world: int, init_file: str, out: str, plan: dict) -> None:
    """One gloo rank: read the epoch (from ``plan["resume"]``'s state), stop after
    ``plan["stop"]`` steps if given, save what it read (and its state) as JSON."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),  # a rank that dies fails the others, not a hang
    )
    try:
        loader = _loader(plan)
        if plan.get("resume"):
            loader.load_state_dict(json.loads(Path(plan["resume"]).read_text()))
        batches = []
        for batch in loader:
            batches.append(_samples(batch, plan["kind"]))
            if len(batches) == plan.get("stop"):
                break
        saved = {"batches": batches, "state": loader.state_dict()}
        if loader.stats.last is not None:  # a whole epoch: what this rank's processes fetched
            saved["downloads"] = loader.stats.last.downloads.as_dict()
        loader.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(saved))
    finally:
        dist.destroy_process_group()


def _run_ranks(out: Path, world: int, plan: dict) -> list[dict]:
    """Run ``world`` forked gloo ranks of ``plan``, killed after ``TIMEOUT_S``; what each
    saved. Gloo's loopback mesh now and then fails to connect (tests/_ddp.py): that set-up,
    and nothing else, is tried once more."""
    out.mkdir()
    for attempt in range(2):
        context = mp.start_processes(
            _rank,
            args=(world, str(out / f"init{attempt}"), str(out), plan),
            nprocs=world,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    pytest.fail(f"{world} ranks of {plan} ran past {TIMEOUT_S} s")
            break
        except mp.ProcessRaisedException as error:
            if attempt or "connectFullMesh" not in str(error):
                raise
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _positions(runs: list[tuple[int, list[dict]]], lanes: int | None) -> dict[int, object]:
    """Global position -> sample, from runs of (first position, every rank's output): each
    step's batches in rank order are its positions, dealt by lane when ``lanes``."""
    sequence: dict[int, object] = {}
    for start, ranks in runs:
        position = start
        for step in zip(*(rank["batches"] for rank in ranks), strict=True):
            samples = [sample for batch in step for sample in batch]
            where = np.arange(position, position + len(samples))
            if lanes:  # NOTE [ The shard-aware order ]: a step sorted by lane, cut by rank
                where = where[np.argsort(where % lanes, kind="stable")]
            for at, sample in zip(where.tolist(), samples, strict=True):
                assert at not in sequence, f"position {at} read twice"
                sequence[at] = sample
            position += len(samples)
    return sequence


def _resume_seed() -> int:
    seed = int(os.environ.get("RESUME_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"RESUME_SEED={seed}")  # replays this run's stop step
    return seed


@pytest.mark.parametrize("kind", ["shards", "mix"])
def test_gloo_ranks_stop_at_a_random_step_and_resume_exactly_on_another_world(url, tmp_path, kind):
    total, lanes = (SAMPLES, 8) if kind == "shards" else (MIXED, None)
    first_batch, resumed_batch = (6, 4) if kind == "shards" else (5, 4)
    steps = total // (4 * first_batch)
    stop = random.Random(_resume_seed()).randrange(1, steps)
    print(f"{kind}: 4 ranks stop after step {stop} of {steps}")
    plan = {"kind": kind, "url": url, "batch": first_batch, "workers": 0}
    whole = _run_ranks(tmp_path / "whole", 4, plan | {"cache": str(tmp_path / "c0")})
    first = _run_ranks(tmp_path / "first", 4, plan | {"cache": str(tmp_path / "c1"), "stop": stop})
    state = first[0]["state"]
    assert state["position"] == stop * 4 * first_batch
    assert all(rank["state"] == state for rank in first)  # every rank saved the same place
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    resumed_plan = plan | {"batch": resumed_batch, "workers": 2, "resume": str(saved)}
    resumed = _run_ranks(tmp_path / "resumed", 3, resumed_plan | {"cache": str(tmp_path / "c2")})

    # the ranks of one node share its cache: each shard fetched once, by one rank's processes
    fetched = [rank["downloads"] for rank in whole]
    manifest = ShardedDataset(url, cache_dir=tmp_path / "c0").manifest
    if kind == "shards":  # every shard is read
        assert sum(f["downloads"] for f in fetched) == len(manifest.shards)
        assert sum(f["bytes_downloaded"] for f in fetched) == manifest.size_bytes
    assert 0 < sum(f["requests"] for f in fetched) == sum(f["downloads"] for f in fetched)
    reference = _positions([(0, whole)], lanes)
    interrupted = _positions([(0, first), (state["position"], resumed)], lanes)
    assert sorted(reference) == list(range(total))
    assert interrupted == reference  # every global step holds the uninterrupted run's samples
    if kind == "shards":  # every sample of the epoch read exactly once
        assert sorted(interrupted.values()) == list(range(SAMPLES))
    else:
        assert {source for source, _ in interrupted.values()} == {"remote", "local"}
