"""distributed=True: one global order, elastic exact resume, exactly-once evaluation.

The multi-process tests run real gloo process groups of 2 and 4 CPU ranks: 4 ranks, then 2 ranks
resuming the 4-rank state, then 4 ranks resuming the 2-rank state. The sampler tests build
each rank's sampler in this process.
"""

import json

import pytest
from _datasets import RandomDraws
from _ddp import SEED, run_rank, spawn_ranks

from fastloader import DataLoader
from fastloader.sampling.distributed import ElasticDistributedSampler, gather_in_order
from fastloader.sampling.samplers import epoch_permutation

N = 52  # with batch_size 3: 4 ranks take 4 full steps and a last one of 1 sample each
BATCH = 3


def _spawn(tmp, name, world_size, plan):
    return spawn_ranks(run_rank, tmp / name, world_size, plan)


def _reference_rows(n, epoch):
    """index -> row [index, draws...] of a clean single-process epoch (seed, epoch only)."""
    loader = DataLoader(RandomDraws(n), batch_size=8, shuffle=True, seed=SEED)
    loader.set_epoch(epoch)
    return {int(row[0]): row for values, _ in loader for row in values.tolist()}


def _global_sequence(ranks, key):
    """The samples in global order: step by step, rank by rank."""
    steps = max(len(rank[key]) for rank in ranks)
    return [
        row
        for step in range(steps)
        for rank in ranks
        if step < len(rank[key])
        for row in rank[key][step]
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    four = _spawn(
        tmp,
        "four",
        4,
        {
            "n": N,
            "batch_size": BATCH,
            "epochs": 2,
            "interrupt": [2, 2],
            "eval": 19,
            "num_workers": 1,
        },
    )
    (tmp / "state4.json").write_text(json.dumps(four[1]["state"]))  # any rank's state
    two = _spawn(
        tmp,
        "two",
        2,
        {
            "n": N,
            "batch_size": 6,
            "resume": str(tmp / "state4.json"),
            "epochs": 1,
            "interrupt": [3, 3],
            "eval": 19,
        },
    )
    (tmp / "state2.json").write_text(json.dumps(two[0]["state"]))
    four_again = _spawn(
        tmp, "four_again", 4, {"n": N, "batch_size": BATCH, "resume": str(tmp / "state2.json")}
    )
    return {"four": four, "two": two, "four_again": four_again}


@pytest.mark.slow
@pytest.mark.parametrize("world", ["four", "two"])
def test_every_sample_once_per_epoch_across_ranks_in_the_global_order(runs, world):
    ranks = runs[world]
    for epoch in range(len(ranks[0]["epochs"])):
        sequence = _global_sequence([{"steps": rank["epochs"][epoch]} for rank in ranks], "steps")
        reference = _reference_rows(N, epoch)
        assert [int(row[0]) for row in sequence] == epoch_permutation(SEED, epoch, N).tolist()
        assert all(row == reference[int(row[0])] for row in sequence)  # same augmentations
        assert len({len(rank["epochs"][epoch]) for rank in ranks}) == 1  # same step count
    if len(ranks[0]["epochs"]) > 1:
        first, second = (
            _global_sequence([{"s": r["epochs"][e]} for r in ranks], "s") for e in (0, 1)
        )
        assert first != second  # reshuffled


@pytest.mark.slow
def test_the_state_is_the_same_on_every_rank(runs):
    for world in ("four", "two"):
        states = [rank["state"] for rank in runs[world]]
        assert all(state == states[0] for state in states)
    assert runs["four"][0]["state"]["position"] == 2 * BATCH * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after", "epoch"), [("four", "two", 2), ("two", "four_again", 3)]
)
def test_resume_on_another_world_size_sees_exactly_the_remaining_samples(
    runs, before, after, epoch
):
    seen = _global_sequence(runs[before], "partial")
    rest = _global_sequence(runs[after], "resumed")
    assert all(rank["resumed_epoch"] == epoch for rank in runs[after])
    order = epoch_permutation(SEED, epoch, N).tolist()
    assert [int(row[0]) for row in seen + rest] == order  # none lost, none repeated, in order
    reference = _reference_rows(N, epoch)
    assert all(row == reference[int(row[0])] for row in seen + rest)  # same augmentations
    assert len({len(rank["resumed"]) for rank in runs[after]}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("world", ["four", "two"])
def test_evaluation_sees_each_sample_exactly_once_and_gathers_in_dataset_order(runs, world):
    ranks = runs[world]
    for rank in ranks:
        assert rank["eval"] == [10.0 * i for i in range(19)]
    counts = [rank["eval_batches"] for rank in ranks]
    assert max(counts) - min(counts) <= 1


@pytest.mark.slow
def test_workers_start_once_per_rank(runs):
    assert all(len(rank["worker_pids"]) == 1 for rank in runs["four"])


# -- the sampler alone: each rank's sampler built here ----------------------------------------


def _rank_samplers(n, batch_size, world_size, **kwargs):
    return [
        ElasticDistributedSampler(
            range(n), batch_size, num_replicas=world_size, rank=rank, seed=SEED, **kwargs
        )
        for rank in range(world_size)
    ]


def _steps(samplers, start=0):
    """Per step, the concatenation of each rank's batch (the global batch)."""
    per_rank = [s.rank_indices(start).tolist() for s in samplers]
    batch = samplers[0].batch_size
    batches = [[ix[i : i + batch] for i in range(0, len(ix), batch)] for ix in per_rank]
    return [sum((b[k] for b in batches if k < len(b)), []) for k in range(max(map(len, batches)))]


def test_one_rank_has_the_order_of_shuffle_true():
    (sampler,) = _rank_samplers(30, 4, 1)
    sampler.set_epoch(3)
    loader = DataLoader(range(30), batch_size=4, shuffle=True, seed=SEED)
    loader.set_epoch(3)
    assert list(sampler) == [int(i) for batch in loader for i in batch]


def test_a_short_last_step_is_split_across_ranks_without_repeats_when_not_shuffled():
    samplers = _rank_samplers(19, 2, 4, shuffle=False)
    assert [len(s) for s in samplers] == [5, 5, 5, 4]  # rank 3 has one batch fewer
    assert sorted(i for s in samplers for i in s) == list(range(19))


def test_a_short_last_step_smaller_than_the_world_is_padded_when_shuffled():
    samplers = _rank_samplers(50, 3, 4)  # 50 = 4 steps of 12 + 2 samples for 4 ranks
    order = samplers[0].global_order().tolist()
    counts = [len(list(s)) for s in samplers]
    assert counts == [13, 13, 13, 13]
    seen = sorted(i for s in samplers for i in s)
    assert seen == sorted(list(range(50)) + order[:2])  # the epoch's first 2 samples, again


def test_drop_last_drops_a_short_global_step():
    samplers = _rank_samplers(50, 3, 4, drop_last=True)
    assert [len(s) for s in samplers] == [12] * 4
    assert _steps(samplers) == [
        samplers[0].global_order()[k * 12 : (k + 1) * 12].tolist() for k in range(4)
    ]


def test_resume_with_another_global_batch_and_drop_last_warns_what_the_end_drops():
    def loader(world_size, rank, batch_size):
        dataset = RandomDraws(50)
        sampler = ElasticDistributedSampler(
            dataset, batch_size, num_replicas=world_size, rank=rank, seed=SEED, drop_last=True
        )
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)

    first = loader(4, 0, 3)
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    assert state["position"] == 12
    resumed = loader(2, 1, 5)  # 38 remain: 3 steps of 10, the last 8 dropped (not 2)
    with pytest.warns(UserWarning, match="drops its last 8 samples.*drops its last 2"):
        resumed.load_state_dict(state)
    rows = [int(i) for values, _ in resumed for i in values[:, 0]]
    order = first.sampler.global_order().tolist()
    assert rows == order[17:22] + order[27:32] + order[37:42]


def test_resume_on_more_ranks_than_samples_left_in_the_last_step_pads_and_warns():
    def loaders(world_size, batch_size):
        dataset = RandomDraws(50)
        return [
            DataLoader(
                dataset,
                batch_size=batch_size,
                sampler=ElasticDistributedSampler(
                    dataset, batch_size, num_replicas=world_size, rank=rank, seed=SEED
                ),
            )
            for rank in range(world_size)
        ]

    first = loaders(2, 3)[0]  # 50 = 8 steps of 6 + 2: no padding on 2 ranks
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()
    assert state["position"] == 12
    resumed = loaders(4, 3)  # 38 = 3 steps of 12 + 2 samples for 4 ranks: pad 2
    for loader in resumed:
        with pytest.warns(UserWarning, match="repeats 2 samples.*drops and repeats nothing"):
            loader.load_state_dict(state)
    seen = [int(i) for loader in resumed for values, _ in loader for i in values[:, 0]]
    order = first.sampler.global_order().tolist()
    assert sorted(seen) == sorted(order[12:] + order[:2])  # the epoch's first 2, again
    assert len({len(loader) for loader in resumed}) == 1


def test_gather_in_order_without_a_process_group_sorts_and_checks():
    assert gather_in_order([2, 0, 1], ["c", "a", "b"], length=3) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="twice"):
        gather_in_order([0, 0], [1, 2])
    with pytest.raises(ValueError, match="no result: 1"):
        gather_in_order([0, 2], [1, 2], length=3)


def test_distributed_rejects_a_sampler():
    with pytest.raises(ValueError, match="sampler"):
        DataLoader(list(range(4)), sampler=[0, 1], distributed=True)
