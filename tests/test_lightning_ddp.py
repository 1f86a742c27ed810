"""fastloader under Lightning's DDP strategy: 2 CPU ranks, Lightning's injected sampler."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")
pytestmark = [pytest.mark.lightning, pytest.mark.slow]

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_ddp")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    for name in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    subprocess.run(
        [sys.executable, str(TESTS / "_lightning_ddp.py"), str(out)],
        env=env,
        cwd=out,
        check=True,
        timeout=240,
    )
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _epoch(rank, epoch):
    return [i for seen_epoch, indices, _ in rank["full"] if seen_epoch == epoch for i in indices]


def test_lightning_injects_its_sampler_and_epochs_reshuffle(ranks):
    assert all(rank["sampler"] == "DistributedSampler" for rank in ranks)
    for epoch in (0, 1):
        assert sorted(i for rank in ranks for i in _epoch(rank, epoch)) == list(range(48))
    for rank in ranks:
        assert _epoch(rank, 0) != _epoch(rank, 1)


def test_workers_start_once_per_rank(ranks):
    pids = [{pid for _, _, step_pids in rank["full"] for pid in step_pids} for rank in ranks]
    assert all(len(rank_pids) == 1 for rank_pids in pids)  # num_workers=1, both epochs
    assert pids[0] != pids[1]


def test_mid_epoch_checkpoint_resumes_with_the_remaining_samples(ranks):
    for rank in ranks:
        assert len(rank["full"]) == 12
        expected = [[epoch, indices] for epoch, indices, _ in rank["full"][8:]]
        assert [[epoch, indices] for epoch, indices, _ in rank["resumed"]] == expected


def test_distributed_true_validation_sees_each_sample_once_and_gathers_in_order(ranks):
    assert all(rank["val_sampler"] == "ElasticDistributedSampler" for rank in ranks)
    for rank in ranks:
        assert rank["gathered"] == [[10.0 * i for i in range(17)]] * 2  # one per epoch
    assert [rank["val_samples"] for rank in ranks] == [[9, 9], [8, 8]]
