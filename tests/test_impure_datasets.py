"""The seeding contract for datasets that are not pure functions of their index (issue 27).

Datasets cache, count, keep private RNGs, wrap others (torch's ``Subset``...), or stream: the
default mode must give the samples of ``seed_rngs="always"``, call ``__getitem__`` once per
delivered sample, and leave the training loop's RNGs alone. NOTE [ Lazy seeding ].
"""

import multiprocessing
import os
import random
import warnings

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import (
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    get_worker_info,
    random_split,
)

from fastloader import DataLoader, LMDBDataset
from fastloader.loader import lazy_seeding
from fastloader.sampling.samplers import BlockShuffleSampler


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _epochs(dataset, seed_rngs="auto", epochs=2, **kwargs):
    kwargs = {"batch_size": 8, "shuffle": True, "seed": 5, **kwargs}
    with DataLoader(dataset, seed_rngs=seed_rngs, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


class CachesNoise(Dataset):
    """Random noise made once per odd index, then served from a cache (as a dataset that
    precomputes augmentations lazily does)."""

    def __init__(self, n: int = 32) -> None:
        self.n = n
        self.cache: dict[int, float] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i % 2 and i not in self.cache:
            self.cache[i] = torch.rand(1).item()
        return torch.tensor([float(i), self.cache.get(i, 0.0)], dtype=torch.float64)


class PrivateAndSparse(Dataset):
    """A private random.Random drawn every sample, the global numpy RNG every 7th."""

    def __init__(self, n: int = 48) -> None:
        self.n = n
        self.rng = random.Random(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        noise = np.random.rand() if i % 7 == 6 else 0.0
        return torch.tensor([float(i), self.rng.random(), noise], dtype=torch.float64)


class Counted(Dataset):
    """Counts the ``__getitem__`` calls of each index across processes; draws from numpy at
    every 5th index from 40 on."""

    def __init__(self, n: int, counts) -> None:
        self.n = n
        self.counts = counts

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        with self.counts.get_lock():
            self.counts[i] += 1
        noise = np.random.rand() if i >= 40 and i % 5 == 4 else 0.0
        return torch.tensor([float(i), noise], dtype=torch.float64)


class Augments(Dataset):
    """Every sample draws from all three RNGs."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        values = [float(i), random.random(), float(np.random.rand()), torch.rand(1).item()]
        return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_caching_dataset_gets_the_samples_of_always(num_workers):
    expected = _epochs(CachesNoise(), "always", num_workers=num_workers, shuffle=False)
    assert _same(_epochs(CachesNoise(), num_workers=num_workers, shuffle=False), expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_private_rng_beside_sparse_global_draws_gets_the_samples_of_always(num_workers):
    expected = _epochs(PrivateAndSparse(), "always", num_workers=num_workers)
    assert _same(_epochs(PrivateAndSparse(), num_workers=num_workers), expected)


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, True), (2, False)])
def test_getitem_runs_once_per_delivered_sample(num_workers, persistent):
    counts = multiprocessing.Array("q", 96)
    kwargs = {"num_workers": num_workers}
    if num_workers:
        kwargs["persistent_workers"] = persistent
        kwargs["prefetch_factor"] = 2
    with DataLoader(Counted(96, counts), batch_size=8, seed=2, **kwargs) as loader:
        delivered = sum(len(batch) for _ in range(3) for batch in loader)
    assert delivered == 3 * 96
    calls = list(counts)
    if num_workers and persistent:
        # persistent workers load the first 2 * 2 batches of the next epoch ahead
        assert calls[32:] == [3] * 64 and set(calls[:32]) <= {3, 4}
    else:
        assert calls == [3] * 96


def test_batches_in_flight_go_one_epoch_ahead_at_most():
    # 12 batches an epoch, up to 16 in flight (NOTE [ Prefetch depth by batch bytes ]): only
    # the next epoch is loaded ahead, never one after it, drained and loaded again
    counts = multiprocessing.Array("q", 96)
    with DataLoader(Counted(96, counts), batch_size=8, seed=2, num_workers=2) as loader:
        delivered = sum(len(batch) for _ in range(3) for batch in loader)
        assert loader._iterator._prefetch_factor == 8
    assert delivered == 3 * 96
    assert set(counts) <= {3, 4}


class DrawsFromEpoch2(Dataset):
    """Draws from numpy at odd indices, only once told it is epoch 2 or later (after its
    probe); counts its calls."""

    def __init__(self) -> None:
        self.epoch = 0
        self.calls = 0

    def __len__(self):
        return 24

    def __getitem__(self, i):
        self.calls += 1
        noise = np.random.rand() if self.epoch >= 2 and i % 2 else 0.0
        return torch.tensor([float(i), noise], dtype=torch.float64)


def _late_epochs(dataset, mode):
    loader = DataLoader(dataset, batch_size=6, seed=1, seed_rngs=mode)  # batches start even
    epochs = []
    for epoch in range(4):
        dataset.epoch = epoch
        epochs.append(list(loader))
    return epochs


def test_a_dataset_that_first_draws_after_its_probe_gets_always_samples_and_a_warning():
    expected = _late_epochs(DrawsFromEpoch2(), "always")
    dataset = DrawsFromEpoch2()
    with pytest.warns(RuntimeWarning, match='seed_rngs="always"') as caught:
        assert _same(_late_epochs(dataset, "auto"), expected)
    assert len(caught) == 1  # once: from then on the RNG is seeded before every sample
    # the batch where it was found (unseeded: NOTE [ Lazy seeding ]), all of it, once more
    assert dataset.calls == 4 * 24 + 6


def test_slow_samples_keep_every_rng_seeded_and_load_once(monkeypatch):
    monkeypatch.setattr(lazy_seeding, "EAGER_ABOVE_S", 0.0)  # every dataset counts as slow
    expected = _late_epochs(DrawsFromEpoch2(), "always")
    dataset = DrawsFromEpoch2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _same(_late_epochs(dataset, "auto"), expected)
    assert dataset.calls == 4 * 24


# -- torch's wrappers ----------------------------------------------------------------------


def test_a_subset_is_seeded_per_sample_like_its_dataset():
    ours = _epochs(Subset(Augments(), range(64)), shuffle=False, epochs=1)
    theirs = _epochs(Augments(), shuffle=False, epochs=1)
    assert _same(ours, theirs)


@pytest.mark.parametrize("wrap", ["subset", "random_split", "stack", "concat", "nested"])
def test_torchs_wrappers_keep_per_sample_seeding_for_any_batch_size(wrap):
    def wrapped():
        base = Augments()
        if wrap == "subset":
            return Subset(base, list(range(0, 64, 2)))
        if wrap == "random_split":
            return random_split(base, [40, 24], generator=torch.Generator().manual_seed(0))[0]
        if wrap == "stack":
            return StackDataset(base, Augments())
        if wrap == "concat":
            return ConcatDataset([base, Augments(16)])
        return Subset(StackDataset(a=base, b=Augments()), range(10, 50))

    def samples(batch_size):
        epochs = _epochs(wrapped(), batch_size=batch_size)
        return [_unbatch(b, i) for epoch in epochs for b in epoch for i in range(_batch_len(b))]

    one, eight = samples(1), samples(8)
    assert len(one) == len(eight) and all(_same(a, b) for a, b in zip(one, eight, strict=True))


def _batch_len(batch):
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    return _batch_len(batch[0])


def _unbatch(batch, i):
    if isinstance(batch, torch.Tensor):
        return batch[i]
    if isinstance(batch, dict):
        return {k: _unbatch(v, i) for k, v in batch.items()}
    return [_unbatch(v, i) for v in batch]


def test_resuming_a_subset_with_another_batch_size_keeps_its_augmentations():
    dataset = Subset(Augments(), range(48))
    reference = torch.cat(list(DataLoader(dataset, batch_size=6, shuffle=True, seed=9)))
    loader = DataLoader(dataset, batch_size=6, shuffle=True, seed=9)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    resumed = DataLoader(dataset, batch_size=5, shuffle=True, seed=9)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat(head + list(resumed)), reference)


# -- iterable datasets and the training loop's RNGs ----------------------------------------


class DrawingStream(IterableDataset):
    """Yields draws from all three RNGs; split across workers."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for position in range(worker, self.n, workers):
            values = [float(position), random.random(), np.random.rand(), torch.rand(1).item()]
            yield torch.tensor(values, dtype=torch.float64)


def test_an_iterable_dataset_without_workers_is_seeded_like_worker_zero():
    def epochs(num_workers, user_seed):
        torch.manual_seed(user_seed)  # the user's state must not matter: the loader's seed does
        random.seed(user_seed)
        np.random.seed(user_seed)
        with DataLoader(DrawingStream(), batch_size=4, seed=3, num_workers=num_workers) as loader:
            return [torch.cat(list(loader)) for _ in range(2)]

    without = epochs(0, user_seed=1)
    assert _same(without, epochs(0, user_seed=2))
    assert _same(without, epochs(1, user_seed=3))
    assert not torch.equal(without[0][:, 1:], without[1][:, 1:])  # each epoch differs


def _training_draws(loader, steps: int = 6):
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    draws = []
    batches = iter(loader) if loader is not None else None
    for _ in range(steps):
        if batches is not None:
            try:
                next(batches)
            except StopIteration:
                batches = iter(loader)  # the next epoch
                next(batches)
        # Gaussians: a cached one is pending in random and NumPy while the loader runs
        draws.append((random.gauss(0, 1), np.random.normal(), torch.randn(1).item()))
    return draws


@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_training_loops_rngs_are_untouched_by_the_loader(mode, kind, num_workers):
    dataset = Augments(16) if kind == "map" else DrawingStream(16)
    without = _training_draws(None)
    loader = DataLoader(dataset, batch_size=4, seed=1, seed_rngs=mode, num_workers=num_workers)
    with loader:
        assert _training_draws(loader) == without


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_with_seeding_off_draws_nothing_itself(num_workers):
    loader = DataLoader(range(16), batch_size=4, seed_rngs="never", num_workers=num_workers)
    with loader:
        assert _training_draws(loader) == _training_draws(None)


# -- reads of RNG states -------------------------------------------------------------------


def _numpy_reads():
    return {
        "np.random.get_state": lambda: np.random.get_state()[1][0],
        "np.random.mtrand.get_state": lambda: np.random.mtrand.get_state()[1][0],
        "get_bit_generator().state": lambda: np.random.get_bit_generator().state["state"]["key"][0],
    }


@pytest.mark.parametrize("read", list(_numpy_reads()))
def test_a_sample_that_reads_numpys_state_sees_its_own_seed(read):
    reader = _numpy_reads()[read]

    class ReadsSparsely(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.tensor([i, int(reader()) if i % 9 == 8 else 0], dtype=torch.int64)

    expected = _epochs(ReadsSparsely(), "always")
    assert _same(_epochs(ReadsSparsely()), expected)


# -- users' files, workers, samplers -------------------------------------------------------


def _noisy(value: bytes):
    return torch.tensor([float(value), torch.rand(1).item()], dtype=torch.float64)


@pytest.fixture
def noisy_lmdb(tmp_path):
    """A user's LMDB environment of 12 values, read through a ``decode`` that draws."""
    env = lmdb.open(str(tmp_path / "env"))
    with env.begin(write=True) as txn:
        for i in range(12):
            txn.put(b"%03d" % i, b"%d" % i)
    env.close()
    return LMDBDataset(tmp_path / "env", decode=_noisy)


def test_a_decode_that_draws_in_a_users_lmdb_is_seeded_per_sample(noisy_lmdb):
    one = torch.cat(list(DataLoader(noisy_lmdb, batch_size=1, seed=4)))
    four = torch.cat(list(DataLoader(noisy_lmdb, batch_size=4, seed=4)))
    assert torch.equal(one, four)
    assert len(set(four[:, 1].tolist())) == 12  # each sample its own draw


def test_subsets_of_a_batch_reader_keep_batch_reads_and_per_sample_seeds(noisy_lmdb, monkeypatch):
    whole = torch.cat(list(DataLoader(noisy_lmdb, batch_size=4, seed=4)))
    reads = []
    read_many = type(noisy_lmdb).read_many
    monkeypatch.setattr(
        type(noisy_lmdb),
        "read_many",
        lambda self, *a, **k: reads.append(1) or read_many(self, *a, **k),
    )
    subset = torch.cat(list(DataLoader(Subset(noisy_lmdb, range(12)), batch_size=4, seed=4)))
    assert torch.equal(subset, whole)  # Subset(ds, range(n))[i] is ds[i]
    assert len(reads) == 3  # one read per batch
    train = random_split(noisy_lmdb, [8, 4], generator=torch.Generator().manual_seed(0))[0]
    nested = Subset(train, [0, 0, 5, 5, 2])  # a sample read twice gets two seeds
    for dataset in (train, nested):
        one = torch.cat(list(DataLoader(dataset, batch_size=1, seed=4)))
        many = torch.cat(list(DataLoader(dataset, batch_size=5, seed=4)))
        assert torch.equal(one, many)
    draws = torch.cat(list(DataLoader(nested, batch_size=5, seed=4)))[:, 1].tolist()
    assert draws[0] != draws[1] and draws[2] != draws[3]


def test_worker_pids_lists_live_workers_without_persistent_workers():
    loader = DataLoader(range(64), batch_size=4, num_workers=2, persistent_workers=False)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:
        os.kill(pid, 0)  # alive
    loader.close()
    assert loader.worker_pids == []


@pytest.mark.parametrize("seed", ["x", 1.5, None, True])
def test_block_shuffle_sampler_refuses_a_seed_that_is_not_an_int_when_built(seed):
    with pytest.raises(TypeError, match="seed"):
        BlockShuffleSampler(range(10), seed=seed)
