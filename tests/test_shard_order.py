"""The shard-aware order and ShardedDataset over a local folder: every sample once per epoch, each
rank on its own shards, exact resume on another world size, batch size and worker count."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastloader import DataLoader, ShardedDataset, ShardOrderSampler, pack
from fastloader.sampling.shard_order import shard_epoch_order
from tests._fields import Indexed

SEED = 7


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "train"
    pack(Indexed(400), path, shard_size="56KB", workers=0)  # 18 shards
    return path


def _shard_of(dataset, indices):
    return {dataset.shard_of(int(i)) for i in indices}


def test_a_sharded_folder_reads_as_one_dataset_in_place(folder):
    dataset = ShardedDataset(folder)
    assert len(dataset) == 400 and dataset.cache is None
    assert len(dataset.shard_counts) > 8
    assert [int(dataset[i]["y"]) for i in range(400)] == list(range(400))
    assert [int(s["x"][0, 0]) for s in dataset.__getitems__([399, 0, 200, 1])] == [399, 0, 200, 1]


def test_the_order_is_a_permutation_from_seed_and_epoch_only():
    counts = [30] * 20 + [7]
    first = shard_epoch_order(SEED, 3, counts, 4, 2)
    assert sorted(first.tolist()) == list(range(607))
    assert np.array_equal(first, shard_epoch_order(SEED, 3, counts, 4, 2))
    assert not np.array_equal(first, shard_epoch_order(SEED, 4, counts, 4, 2))
    assert not np.array_equal(first, np.arange(607))


def test_a_window_of_shards_is_read_at_once_per_lane():
    counts = [50] * 40
    order = shard_epoch_order(SEED, 0, counts, 4, 2)
    shards = order // 50
    # any 100 consecutive positions (25 per lane) touch at most 4 lanes x (2 + 1) shards
    assert max(len(set(shards[k : k + 100])) for k in range(0, 1900, 100)) <= 12


def test_each_rank_reads_its_own_shards_when_lanes_are_a_multiple_of_the_world(folder):
    dataset = ShardedDataset(folder, lanes=4, window=2)
    shards = len(dataset.shard_counts)
    for world in (1, 2, 4):
        per_rank = [
            _shard_of(dataset, ShardOrderSampler(dataset, 8 // world, world, r, seed=SEED))
            for r in range(world)
        ]
        # a shard cut by a lane's end is read by two ranks; nothing else is shared
        assert sum(len(s) for s in per_rank) <= shards + 4
        assert set().union(*per_rank) == set(range(shards))


def _loaders(dataset, world, batch, workers=0, **sampler):
    return [
        DataLoader(
            dataset,
            batch_size=batch,
            num_workers=workers,
            sampler=ShardOrderSampler(dataset, batch, world, rank, seed=SEED, **sampler),
            seed=SEED,
        )
        for rank in range(world)
    ]


def _ys(batch) -> list[int]:
    return [int(y) for y in batch["y"]]


def test_exact_resume_on_another_world_size_batch_size_and_worker_count(folder):
    dataset = ShardedDataset(folder)
    first = _loaders(dataset, 4, 5)
    iterators = [iter(loader) for loader in first]
    seen = []
    for _ in range(6):  # 6 global steps of 20
        seen += [y for it in iterators for y in _ys(next(it))]
    state = first[0].state_dict()
    assert state["position"] == 120 and all(loader.state_dict() == state for loader in first)
    resumed = _loaders(ShardedDataset(folder), 3, 7, workers=2)
    for loader in resumed:
        loader.load_state_dict(state)
        seen += [y for batch in loader for y in _ys(batch)]
    assert sorted(seen) == list(range(400))  # every sample once: no repeat, no gap
    # the steps before the stop are the uninterrupted run's
    whole = _loaders(ShardedDataset(folder), 4, 5)
    iterators = [iter(loader) for loader in whole]
    again = [y for _ in range(6) for it in iterators for y in _ys(next(it))]
    assert again == seen[:120]


def test_resume_with_another_order_shape_is_refused_by_name(folder):
    dataset = ShardedDataset(folder)
    loader = _loaders(dataset, 1, 4)[0]
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    other = _loaders(dataset, 1, 4, lanes=2)[0]
    with pytest.raises(ValueError, match="lanes=8 window=4"):
        other.load_state_dict(state)


def test_samples_are_seeded_by_index_whatever_the_worker_count(folder):
    def noisy(sample):
        return {**sample, "r": random.random()}

    dataset = ShardedDataset(folder, sample_transform=noisy)
    runs = []
    for workers in (0, 2):
        loader = _loaders(dataset, 1, 16, workers=workers)[0]
        runs.append({y: r for b in loader for y, r in zip(_ys(b), b["r"].tolist(), strict=True)})
    assert runs[0] == runs[1] and len(runs[0]) == 400


def test_the_dataset_pickles_without_open_shards(folder):
    import pickle

    dataset = ShardedDataset(folder)
    dataset[0]
    copy = pickle.loads(pickle.dumps(dataset))
    assert not copy._open and int(copy[5]["y"]) == 5


def test_shuffle_true_on_a_sharded_dataset_takes_the_shard_aware_order(folder):
    dataset = ShardedDataset(folder)
    loader = DataLoader(dataset, batch_size=16, shuffle=True, seed=SEED)
    assert isinstance(loader.sampler, ShardOrderSampler)
    ys = [y for batch in loader for y in _ys(batch)]
    assert sorted(ys) == list(range(400)) and ys != list(range(400))
    assert ys == [y for batch in _loaders(dataset, 1, 16)[0] for y in _ys(batch)]


@pytest.mark.parametrize("open_shards", [None, 9])
def test_each_shard_is_opened_once_an_epoch_and_not_again_the_next(
    folder, monkeypatch, open_shards
):
    """NOTE [ How many shards stay open ]: an LRU of open shards at the order's working set
    reopened shards all epoch; by default a process opens each shard once and keeps it."""
    import fastloader.datasets.sharded as sharded

    opened = []
    real_open = sharded.open_pack
    monkeypatch.setattr(
        sharded, "open_pack", lambda path, **kw: opened.append(path) or real_open(path, **kw)
    )
    dataset = ShardedDataset(folder, lanes=2, window=2, open_shards=open_shards)
    loader = DataLoader(dataset, batch_size=16, shuffle=True, seed=SEED)
    epochs = []
    for _ in range(2):
        opened.clear()
        ys = [y for batch in loader for y in _ys(batch)]
        assert sorted(ys) == list(range(400))
        epochs.append(len(opened))
    shards = len(dataset.shard_counts)
    if open_shards is None:  # every shard open by the first epoch's end, none reopened after
        assert epochs == [shards, 0]
    else:  # a bound the user set holds: the next epoch reopens what was closed
        assert len(dataset._open) <= open_shards and epochs[1] > 0


@pytest.mark.parametrize(
    ("args", "digest"),
    [
        ((0, 0, [250] * 80, 8, 4), "b9b3d2c33c99f96a"),
        ((7, 3, [13, 0, 250, 1, 99, 400, 2], 3, 2), "7b8caea093d8a2c8"),
    ],
)
def test_the_order_is_the_one_earlier_releases_saved_states_in(args, digest):
    # a state saved by the last release resumes at its position in this release's order, so
    # the order of (seed, epoch, counts, lanes, window) never changes (digests of the release
    # that made the first sharded packs, before its sort was made faster)
    import xxhash

    order = shard_epoch_order(*args)
    assert xxhash.xxh3_64_hexdigest(order.astype("<i8").tobytes()) == digest


class _Counts:
    def __init__(self, counts: list[int]) -> None:
        self.shard_counts = counts

    def __len__(self) -> int:
        return sum(self.shard_counts)


def test_each_rank_gets_its_part_of_every_step_sorted_by_lane_from_any_position():
    # the dealing of whole steps is computed once per place among the lanes; here each rank's
    # indices are checked against every step's positions sorted by lane one by one (NOTE [ The
    # shard-aware order ]), over world sizes, batch sizes not a multiple of lanes, starts
    rng = np.random.default_rng(7)
    for trial in range(60):
        counts = rng.integers(1, 90, rng.integers(1, 30)).tolist()
        lanes, window = int(rng.integers(1, 10)), int(rng.integers(1, 5))
        world, batch = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        start = int(rng.integers(0, sum(counts))) if trial % 2 else 0
        args = dict(num_replicas=world, seed=trial, lanes=lanes, window=window, drop_last=True)
        samplers = [ShardOrderSampler(_Counts(counts), batch, rank=r, **args) for r in range(world)]
        order = shard_epoch_order(trial, 0, counts, lanes, window)
        indices = [sampler.rank_indices(start).tolist() for sampler in samplers]
        step = world * batch
        for at in range(start, start + (len(order) - start) // step * step, step):
            dealt = sorted(range(at, at + step), key=lambda position: position % lanes)
            for rank in range(world):
                mine = indices[rank][(at - start) // world :][:batch]
                want = order[dealt[rank * batch : (rank + 1) * batch]].tolist()
                assert mine == want, (trial, at, rank)
