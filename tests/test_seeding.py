"""The seeding contract: (seed, epoch, index) decides every sample's randomness."""

import random

import numpy as np
import pytest
import torch
from _datasets import BatchedDraws, CountingStream, RandomDraws

from fastloader import DataLoader


def _epochs(loader, epochs=2):
    return [torch.cat([values for values, _ in loader]) for _ in range(epochs)]


@pytest.fixture(scope="module")
def reference():
    return _epochs(DataLoader(RandomDraws(24), batch_size=5, shuffle=True, seed=11))


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(1, True), (3, True), (1, False), (3, False)]
)
def test_same_batches_for_any_worker_count_and_persistence(reference, num_workers, persistent):
    loader = DataLoader(
        RandomDraws(24),
        batch_size=5,
        shuffle=True,
        seed=11,
        num_workers=num_workers,
        persistent_workers=persistent,
    )
    for ours, expected in zip(_epochs(loader), reference, strict=False):
        assert torch.equal(ours, expected)
    loader.close()


@pytest.mark.slow
def test_same_batches_with_spawned_workers(reference):
    loader = DataLoader(
        RandomDraws(24),
        batch_size=5,
        shuffle=True,
        seed=11,
        num_workers=2,
        multiprocessing_context="spawn",
    )
    for ours, expected in zip(_epochs(loader), reference, strict=False):
        assert torch.equal(ours, expected)
    loader.close()


def test_each_epoch_draws_differently(reference):
    first, second = reference
    assert not torch.equal(first[:, 1:], second[:, 1:])
    assert sorted(first[:, 0].tolist()) == sorted(second[:, 0].tolist()) == list(range(24))
    assert first[:, 0].tolist() != second[:, 0].tolist()  # reshuffled


def test_every_rng_is_seeded_and_samples_differ(reference):
    values = reference[0]
    for column in (1, 2, 3):  # numpy, random, torch
        assert len(set(values[:, column].tolist())) == len(values)


def test_different_seeds_draw_differently(reference):
    other = _epochs(DataLoader(RandomDraws(24), batch_size=5, shuffle=True, seed=12))
    assert not torch.equal(other[0], reference[0])


def test_sample_draws_do_not_depend_on_batch_size_or_order():
    by_index = {}
    for batch_size, shuffle in ((5, True), (24, False), (1, False)):
        loader = DataLoader(RandomDraws(24), batch_size=batch_size, shuffle=shuffle, seed=11)
        values = torch.cat([v for v, _ in loader])
        for row in values.tolist():
            by_index.setdefault(int(row[0]), set()).add(tuple(row[1:]))
    assert all(len(draws) == 1 for draws in by_index.values())


def test_torch_manual_seed_makes_default_seed_repeatable():
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        loader = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, num_workers=1)
        runs.append(_epochs(loader))
        loader.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=False))
    torch.manual_seed(4321)
    other = DataLoader(RandomDraws(12), batch_size=4, shuffle=True)
    assert not torch.equal(_epochs(other)[0], runs[0][0])


def test_generator_decides_the_default_seed():
    seeds = [
        DataLoader(range(4), generator=torch.Generator().manual_seed(s)).seed for s in (1, 1, 2)
    ]
    assert seeds[0] == seeds[1] != seeds[2]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batched_datasets_are_seeded_per_batch(num_workers):
    loader = DataLoader(BatchedDraws(12), batch_size=4, seed=5, num_workers=num_workers)
    values = torch.cat([v for v, _ in loader])
    reference = torch.cat([v for v, _ in DataLoader(BatchedDraws(12), batch_size=4, seed=5)])
    assert torch.equal(values, reference)
    per_batch = values[:, 1].reshape(3, 4)
    assert (per_batch == per_batch[:, :1]).all()  # one draw per batch
    assert len(set(per_batch[:, 0].tolist())) == 3
    loader.close()


def _stream_draws(loader):
    return {(int(w), int(p)): d for batch in loader for w, p, d in batch.tolist()}


def test_iterable_datasets_are_seeded_per_seed_epoch_and_worker():
    loader = DataLoader(CountingStream(12), batch_size=2, seed=3, num_workers=2)
    first, second = _stream_draws(loader), _stream_draws(loader)
    again = DataLoader(CountingStream(12), batch_size=2, seed=3, num_workers=2)
    assert _stream_draws(again) == first  # same seed, same epoch
    assert first.keys() == second.keys() and first != second  # next epoch differs
    per_worker = {}
    for (worker, _position), draw in first.items():
        per_worker.setdefault(worker, []).append(draw)
    assert per_worker[0][0] != per_worker[1][0]  # workers do not repeat each other
    loader.close()
    again.close()


class _InitRecorder:
    def __init__(self):
        self.seen = None

    def __call__(self, worker_id):
        info = torch.utils.data.get_worker_info()
        info.dataset.tag = f"configured by worker {worker_id}"


class _Tagged(torch.utils.data.Dataset):
    tag = "not configured"

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.tag


def test_user_worker_init_fn_runs_and_sees_the_users_dataset():
    loader = DataLoader(_Tagged(), batch_size=None, num_workers=2, worker_init_fn=_InitRecorder())
    tags = set(loader)
    assert tags == {"configured by worker 0", "configured by worker 1"}
    loader.close()


def test_main_process_loading_leaves_training_randomness_alone():
    def training_draws(loader):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        draws = []
        for _ in loader or range(3):
            draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
        return draws

    without = training_draws(None)
    with_loader = training_draws(DataLoader(RandomDraws(3), batch_size=1, seed=1))
    assert with_loader == without


def test_seed_rngs_equals_seeding_each_library_itself():
    from fastloader.loader.seeding import seed_rngs

    def draws():
        return (random.random(), random.gauss(0, 1), np.random.normal(), torch.randn(2).tolist())

    seed = 2**63 + 12345
    random.gauss(0, 1), np.random.normal()  # leave cached Gaussians behind: seeding drops them
    seed_rngs(seed)
    ours = draws()
    random.gauss(0, 1), np.random.normal()
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)
    assert ours == draws()


def _random_augment(image):
    return random.random() + float(np.random.rand()) + float(torch.rand(1))


class _OneByOne(torch.utils.data.Dataset):
    """The same dataset without batch reads: plain dataset[i], seeded per sample."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]


def test_packed_datasets_seed_each_sample_while_reading_whole_batches(tmp_path):
    from fastloader import LMDBDataset
    from fastloader.formats import RecordKind, encode_record, open_writer

    path = tmp_path / "p.lmdb"
    with open_writer(path, "lmdb", store="raw", classes=["a"]) as writer:
        for index in range(10):
            pixels = np.full((2, 2, 3), index, dtype=np.uint8)
            writer.append(encode_record(pixels, 0, RecordKind.RAW), 0)
    dataset = LMDBDataset(path, decode="numpy", transform=_random_augment)

    def draws(data, batch_size, num_workers):
        loader = DataLoader(
            data, batch_size=batch_size, shuffle=True, seed=8, num_workers=num_workers
        )
        with loader:
            return [torch.cat([values for values, _ in loader]).tolist() for _ in range(2)]

    reference = draws(_OneByOne(dataset), 4, 0)
    assert reference[0] != reference[1]
    assert draws(dataset, 4, 0) == reference
    assert draws(dataset, 4, 2) == reference
    # Per-sample seeds: a sample's augmentation does not depend on the batch it falls in.
    assert draws(dataset, 3, 2) == reference


class _Pure(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        return index


class _DrawsThenFails(torch.utils.data.Dataset):
    """Draws from every RNG (so every sample is seeded), then fails at index 7."""

    def __init__(self, error=ValueError):
        self.error = error

    def __len__(self):
        return 12

    def __getitem__(self, index):
        value = random.random() + np.random.rand() + torch.rand(1).item()
        if index == 7:
            raise self.error("sample 7")
        return value


class _Batched(_Pure):
    def __getitems__(self, indices):
        return [index + torch.rand(1).item() for index in indices]


def _training_draws(batches):
    """The training loop's draws between ``batches`` (a callable giving the next batch)."""
    random.seed(0)
    np.random.seed(0)
    np.random.normal()  # a cached Gaussian the training loop owns
    torch.manual_seed(0)
    draws = []
    for _ in range(4):
        batches()
        draws.append((random.random(), np.random.normal(), torch.rand(1).item()))
    return draws


@pytest.mark.parametrize(
    "dataset",
    [_Pure(), _DrawsThenFails(), _DrawsThenFails(KeyboardInterrupt), _Batched()],
    ids=["unseeded", "seeded-raising", "interrupted", "batched"],
)
def test_the_training_loops_states_survive_every_kind_of_batch(dataset):
    # rngs.TrainingStates: saved only when a batch seeds, put back however the batch ends
    loader = DataLoader(dataset, batch_size=4, seed=1)
    if isinstance(dataset, _Pure):
        list(loader)  # the probe: from now on its batches are loaded unseeded
    state = {"iterator": iter(loader), "raised": 0}

    def next_batch():
        try:
            next(state["iterator"])
        except (ValueError, KeyboardInterrupt) as error:
            assert "sample 7" in str(error)
            state["raised"] += 1
        except StopIteration:
            state["iterator"] = iter(loader)

    assert _training_draws(next_batch) == _training_draws(lambda: None)
    assert state["raised"] == (1 if isinstance(dataset, _DrawsThenFails) else 0)
