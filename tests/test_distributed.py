"""distributed=True with a real gloo process group of 2 CPU ranks."""

import pytest
import torch
import torch.multiprocessing as mp
from _ddp import run_rank

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(run_rank, args=(2, str(tmp / "init"), str(tmp), 20), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(2)]


def test_every_sample_appears_exactly_once_per_epoch_across_ranks(two_ranks):
    for epoch in range(2):
        seen = [i for rank in two_ranks for batch in rank["epochs"][epoch] for i in batch]
        assert sorted(seen) == list(range(20))


def test_ranks_get_equal_batch_counts_and_reshuffle_each_epoch(two_ranks):
    counts = {len(rank["epochs"][epoch]) for rank in two_ranks for epoch in range(2)}
    assert counts == {4}  # 10 samples per rank, batch size 3
    for rank in two_ranks:
        assert rank["epochs"][0] != rank["epochs"][1]


def test_resume_works_per_rank(two_ranks):
    for rank in two_ranks:
        assert rank["resumed"] == rank["uninterrupted"]


def test_distributed_rejects_a_sampler():
    from fastloader import DataLoader

    with pytest.raises(ValueError, match="sampler"):
        DataLoader(list(range(4)), sampler=[0, 1], distributed=True)
