"""Exact mid-epoch resume: state_dict/load_state_dict."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _datasets import RandomDraws
from _states import VERSION_1_MID_EPOCH

from fastloader import DataLoader


def _loader(num_workers, seed=21):
    return DataLoader(
        RandomDraws(22), batch_size=4, shuffle=True, num_workers=num_workers, seed=seed
    )


def _uninterrupted(epochs=3):
    loader = _loader(0)
    return [values for _ in range(epochs) for values, _ in loader]


@pytest.mark.parametrize(("before", "after"), [(0, 0), (2, 1), (0, 2), (1, 0)])
def test_resumed_loader_yields_exactly_the_remaining_batches(before, after):
    expected = _uninterrupted()
    per_epoch = len(expected) // 3
    stop_epoch, stop_batch = 1, 3

    first = _loader(before)
    seen = []
    for epoch in range(stop_epoch + 1):
        for values, _ in first:
            seen.append(values)
            if epoch == stop_epoch and len(seen) == per_epoch * stop_epoch + stop_batch:
                break
    state = json.loads(json.dumps(first.state_dict()))  # small and JSON-able
    first.close()
    assert state["epoch"] == stop_epoch and state["batches_consumed"] == stop_batch

    resumed = _loader(after, seed=None)  # the seed comes from the state
    resumed.load_state_dict(state)
    rest = [values for values, _ in resumed]
    rest += [values for values, _ in resumed]
    resumed.close()
    assert len(seen) + len(rest) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(seen + rest, expected, strict=False))


def test_state_after_a_complete_epoch_resumes_at_the_next_epoch():
    expected = _uninterrupted(2)
    first = _loader(0)
    list(first)
    resumed = _loader(0, seed=None)
    resumed.load_state_dict(first.state_dict())
    assert all(
        torch.equal(a, b)
        for (a, _), b in zip(resumed, expected[len(expected) // 2 :], strict=False)
    )
    assert resumed.epoch == 1


@pytest.mark.slow
def test_resume_in_another_process(tmp_path: Path):
    first = _loader(1)
    iterator = iter(first)
    consumed = [next(iterator)[0] for _ in range(2)]
    (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
    first.close()
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _datasets import RandomDraws
        from fastloader import DataLoader
        loader = DataLoader(RandomDraws(22), batch_size=4, shuffle=True, num_workers=1)
        loader.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
        torch.save([v for v, _ in loader], {str(tmp_path / "rest.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    rest = torch.load(tmp_path / "rest.pt")
    expected = _uninterrupted(1)
    assert all(torch.equal(a, b) for a, b in zip(consumed + rest, expected, strict=False))
    assert len(consumed) + len(rest) == len(expected)


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({}, "state_dict"),
        ({"fastloader_state_version": 99}, "version"),
        (
            {
                "fastloader_state_version": 1,
                "seed": 1,
                "epoch": -1,
                "batches_consumed": 0,
                "epoch_started": True,
                "epoch_complete": False,
            },
            "non-negative",
        ),
        (
            {
                "fastloader_state_version": 1,
                "seed": "x",
                "epoch": 0,
                "batches_consumed": 0,
                "epoch_started": True,
                "epoch_complete": False,
            },
            "seed",
        ),
    ],
)
def test_bad_state_is_rejected_with_a_clear_error(state, problem):
    with pytest.raises(ValueError, match=problem):
        _loader(0).load_state_dict(state)


# -- position in samples: another batch_size or num_workers continues exactly ----------------


def _rows(loader, stop_after=None):
    """Rows [index, numpy, random, torch draws] of one epoch, optionally interrupted."""
    rows = []
    for taken, (values, _) in enumerate(loader, start=1):
        rows.append(values)
        if taken == stop_after:
            break
    return torch.cat(rows) if rows else torch.empty(0, 4, dtype=torch.float64)


def _shuffled(batch_size, num_workers, n=100, **kwargs):
    return DataLoader(
        RandomDraws(n),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        seed=3,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("before", "after"),
    [((8, 0), (16, 0)), ((16, 2), (8, 0)), ((8, 2), (8, 0))],
    ids=["batch_size 8->16", "batch_size 16->8, workers 2->0", "workers 2->0"],
)
def test_resume_into_another_batch_size_or_worker_count_is_exact(before, after):
    clean = _shuffled(8, 0)
    clean.set_epoch(1)
    expected = _rows(clean)  # samples and augmentations of a clean epoch 1

    first = _shuffled(*before)
    list(first)  # epoch 0
    seen = _rows(first, stop_after=3)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    assert state["epoch"] == 1 and state["position"] == 3 * before[0]

    resumed = _shuffled(*after)
    resumed.load_state_dict(state)
    rest = _rows(resumed)
    resumed.close()
    assert len(seen) + len(rest) == 100
    assert torch.equal(torch.cat([seen, rest]), expected)  # indices and every RNG draw
    assert resumed.epoch == 1


def test_resume_with_drop_last_and_another_batch_size_warns_what_the_end_drops():
    first = _shuffled(8, 0, drop_last=True)
    seen = _rows(first, stop_after=5)  # 40 of 100 samples
    resumed = _shuffled(16, 0, drop_last=True)
    with pytest.warns(UserWarning, match="drops its last 12 samples.*drops its last 4"):
        resumed.load_state_dict(first.state_dict())
    rest = _rows(resumed)
    order = [int(i) for i in _rows(_shuffled(8, 0))[:, 0]]
    assert [int(i) for i in torch.cat([seen, rest])[:, 0]] == order[:88]


def test_resume_into_batches_of_the_same_size_does_not_warn(recwarn):
    first = _shuffled(8, 0, drop_last=True)
    _rows(first, stop_after=5)
    _shuffled(8, 0, drop_last=True).load_state_dict(first.state_dict())
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def _mid_epoch_state(loader, batches=2):
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (lambda: _shuffled(8, 0, n=90), "dataset length differs"),
        (lambda: DataLoader(RandomDraws(100), batch_size=8, seed=3), "sampler kind differs"),
        (lambda: _shuffled(8, 0, drop_last=True), "drop_last differs"),
        (
            lambda: DataLoader(
                RandomDraws(100),
                batch_size=8,
                sampler=torch.utils.data.RandomSampler(RandomDraws(100)),
            ),
            "not a function of",
        ),
    ],
    ids=["length", "shuffle", "drop_last", "unseeded sampler"],
)
def test_mid_epoch_resume_that_cannot_be_exact_raises_naming_the_field(other, field):
    state = _mid_epoch_state(_shuffled(8, 0))
    with pytest.raises(ValueError, match=field):
        other().load_state_dict(state)


def test_a_state_saying_shuffle_false_is_refused_by_a_shuffled_loader():
    state = _mid_epoch_state(DataLoader(RandomDraws(100), batch_size=8))
    with pytest.raises(ValueError, match="sampler kind differs.*'sequential'.*'shuffle'"):
        _shuffled(8, 0).load_state_dict(state)


def test_position_past_the_end_of_the_epoch_raises():
    state = _mid_epoch_state(_shuffled(8, 0))
    state["position"] = 101
    with pytest.raises(ValueError, match="past the end"):
        _shuffled(8, 0).load_state_dict(state)


def test_torch_distributed_sampler_state_refuses_another_world_size():
    def loader(world_size):
        dataset = RandomDraws(100)
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=0)
        return DataLoader(dataset, batch_size=4, sampler=sampler)

    state = _mid_epoch_state(loader(4))
    with pytest.raises(ValueError, match="world size differs.*distributed=True"):
        loader(2).load_state_dict(state)
    resumed = loader(4)
    resumed.load_state_dict(state)  # the same world size resumes
    assert len(_rows(resumed)) == 25 - 8


def test_iterable_dataset_cannot_resume_mid_epoch_but_can_at_a_boundary():
    from _datasets import CountingStream

    loader = DataLoader(CountingStream(12), batch_size=2)
    state = _mid_epoch_state(loader)
    with pytest.raises(ValueError, match="iterable dataset"):
        DataLoader(CountingStream(12), batch_size=2).load_state_dict(state)
    list(loader)  # finish a whole epoch
    other = DataLoader(CountingStream(12), batch_size=2)
    other.load_state_dict(loader.state_dict())
    assert other.epoch == 2


def test_at_an_epoch_boundary_the_settings_may_change():
    first = _shuffled(8, 0)
    list(first)
    other = DataLoader(RandomDraws(50), batch_size=5)  # another length, no shuffle
    other.load_state_dict(first.state_dict())
    assert other.epoch == 1 and len(_rows(other)) == 50


def test_version_1_state_mid_epoch_is_read_with_the_same_batch_size_and_a_warning():
    expected = _rows(_shuffled(8, 0))
    legacy = dict(VERSION_1_MID_EPOCH)
    resumed = _shuffled(8, 0)
    with pytest.warns(UserWarning, match="version-1"):
        resumed.load_state_dict(legacy)
    assert torch.equal(_rows(resumed), expected[40:])


def test_version_1_state_mid_epoch_is_refused_for_the_global_distributed_order():
    from fastloader.sampling.distributed import ElasticDistributedSampler

    dataset = RandomDraws(100)
    sampler = ElasticDistributedSampler(dataset, 4, num_replicas=2, rank=0)
    legacy = dict(VERSION_1_MID_EPOCH)
    with pytest.raises(ValueError, match="version-1"):
        DataLoader(dataset, batch_size=4, sampler=sampler).load_state_dict(legacy)


def test_state_size_does_not_grow_with_the_dataset():
    sizes = []
    for n in (100, 10_000_000):
        loader = DataLoader(range(n), batch_size=4, shuffle=True, seed=1)
        state = _mid_epoch_state(loader, batches=1)
        sizes.append(len(json.dumps(state)))
    assert abs(sizes[0] - sizes[1]) <= 10  # only the digits of the length differ


def _out_of_order_loader(**overrides):
    settings = dict(batch_size=4, shuffle=True, num_workers=2, seed=5, in_order=False)
    settings.update(overrides)
    return DataLoader(RandomDraws(24), **settings)


def test_mid_epoch_state_taken_out_of_order_is_refused_naming_in_order():
    with _out_of_order_loader() as first:
        iterator = iter(first)
        next(iterator)
        next(iterator)
        state = first.state_dict()  # never raises: Lightning saves on every checkpoint
    assert state["order"]["in_order"] is False
    for loader in (_out_of_order_loader(), _out_of_order_loader(in_order=True, num_workers=0)):
        with loader, pytest.raises(ValueError, match="in_order=False") as caught:
            loader.load_state_dict(json.loads(json.dumps(state)))
        assert "epoch boundary" in str(caught.value)


def test_out_of_order_state_at_an_epoch_boundary_resumes():
    expected = [values for values, _ in _out_of_order_loader(num_workers=0)]  # one epoch
    with _out_of_order_loader() as first:
        assert sorted(len(values) for values, _ in first) == [4] * 6
        state = first.state_dict()
    with _out_of_order_loader(num_workers=0) as resumed:
        resumed.load_state_dict(state)
        assert resumed.epoch == 1
        assert len([values for values, _ in resumed]) == len(expected)


def test_in_order_false_without_workers_is_in_order_and_resumes_mid_epoch():
    expected = [values for values, _ in _loader(0)]
    first = DataLoader(RandomDraws(22), batch_size=4, shuffle=True, seed=21, in_order=False)
    iterator = iter(first)
    seen = [next(iterator)[0] for _ in range(2)]
    state = first.state_dict()
    assert state["order"]["in_order"] is True
    resumed = _loader(0)
    resumed.load_state_dict(state)
    rest = [values for values, _ in resumed]
    assert len(seen + rest) == len(expected)
    for a, b in zip(seen + rest, expected, strict=True):
        assert torch.equal(a, b)


def test_version_2_state_without_in_order_is_read_as_in_order():
    first = _loader(0)
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    del state["order"]["in_order"]  # as saved before in_order was recorded
    resumed = _loader(0)
    resumed.load_state_dict(state)
    assert len([values for values, _ in resumed]) == 5


def test_a_block_shuffle_resumes_with_its_seed_and_refuses_other_blocks():
    from fastloader.sampling.samplers import BlockShuffleSampler

    data = list(range(100))

    def loader(seed: int = 3, block_size: int = 8) -> DataLoader:
        sampler = BlockShuffleSampler(data, seed, block_size=block_size, window=4)
        return DataLoader(data, batch_size=5, sampler=sampler)

    first = loader()
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    rest = [batch.tolist() for batch in iterator]
    resumed = loader(seed=99)  # the state's seed wins
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == rest
    with pytest.raises(ValueError, match="blocks 8x4.*blocks 16x4"):
        loader(block_size=16).load_state_dict(state)
