"""NOTE [ Lazy seeding ]: seed_rngs="auto" gives the samples of seeding every RNG every time."""

import random
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from fastloader import DataLoader
from fastloader.loader.rngs import FINGERPRINTS, StateKeeper, all_fingerprints
from fastloader.loader.seeding import resolve_seed_rngs
from fastloader.loader.state_reads import StateReads
from fastloader.sampling.seeds import batch_seeds, sample_seed


class SometimesDraws(Dataset):
    """Draws from one RNG only at some indices (as a data-dependent augmentation does)."""

    def __init__(self, n: int, rng: str, every: int = 7) -> None:
        self.n, self.rng, self.every = n, rng, every
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        draw = 0.0
        if i % self.every == self.every - 1:
            if self.rng == "random":
                draw = random.gauss(0, 1)
            elif self.rng == "numpy":
                draw = float(np.random.normal())
            else:
                draw = float(torch.randn(1))
        return torch.tensor([float(i), draw], dtype=torch.float64)


class AlwaysDraws(SometimesDraws):
    def __getitem__(self, i):
        self.calls += 1
        values = [float(i), random.random(), float(np.random.rand()), float(torch.rand(1))]
        return torch.tensor(values, dtype=torch.float64)


def mixup_collate(samples):
    """A collate_fn that draws (mixup-like): its randomness must not depend on the mode."""
    batch = torch.stack(samples)
    return batch, torch.rand(1), np.random.rand(), random.random()


def _epochs(dataset, seed_rngs, num_workers=0, epochs=2, **kwargs):
    loader = DataLoader(
        dataset,
        batch_size=6,
        shuffle=True,
        seed=3,
        num_workers=num_workers,
        seed_rngs=seed_rngs,
        **kwargs,
    )
    with loader:
        return [list(loader) for _ in range(epochs)]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("rng", ["random", "numpy", "torch"])
def test_auto_gives_the_samples_of_always_when_a_dataset_draws_now_and_then(rng):
    expected = _epochs(SometimesDraws(40, rng), "always")
    assert _same(_epochs(SometimesDraws(40, rng), "auto"), expected)
    assert _same(_epochs(SometimesDraws(40, rng), "auto", num_workers=2), expected)


def test_auto_gives_the_samples_of_always_for_a_dataset_that_always_draws():
    expected = _epochs(AlwaysDraws(30, "any"), "always")
    dataset = AlwaysDraws(30, "any")
    assert _same(_epochs(dataset, "auto"), expected)
    assert dataset.calls == 60  # found drawing at its first sample: nothing loaded twice


def test_a_dataset_without_randomness_is_loaded_once_per_sample():
    dataset = SometimesDraws(30, "torch", every=10**9)
    assert _same(_epochs(dataset, "auto"), _epochs(SometimesDraws(30, "torch", 10**9), True))
    assert dataset.calls == 60


def test_collate_fn_randomness_does_not_depend_on_the_mode_or_workers():
    expected = _epochs(SometimesDraws(24, "numpy"), "always", collate_fn=mixup_collate)
    for num_workers in (0, 2):
        ours = _epochs(
            SometimesDraws(24, "numpy"), "auto", num_workers=num_workers, collate_fn=mixup_collate
        )
        assert _same(ours, expected)


def test_never_leaves_the_rngs_to_the_training_loop_as_torch_does():
    torch.manual_seed(7)
    expected = [float(torch.rand(1)) for _ in range(6)]
    loader = DataLoader(AlwaysDraws(6, "any"), batch_size=2, seed_rngs=False)
    torch.manual_seed(7)
    draws = [row[3].item() for batch in loader for row in batch]
    assert draws == expected
    assert loader.seed_rngs == "never"


def test_main_process_loading_in_auto_leaves_training_randomness_alone():
    def training_draws(loader):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        draws = []
        for _ in loader or range(4):
            # odd numbers of Gaussians: a cached one is pending when each batch is loaded
            draws.append((random.gauss(0, 1), np.random.normal(), torch.randn(1).item()))
        return draws

    without = training_draws(None)
    for dataset in (SometimesDraws(8, "numpy", every=2), SometimesDraws(8, "torch", 10**9)):
        assert training_draws(DataLoader(dataset, batch_size=2, seed=1)) == without


def test_the_failing_index_is_named_when_a_lazily_loaded_sample_raises():
    class Fails(SometimesDraws):
        def __getitem__(self, i):
            if i == 4:
                raise KeyError("no sample 4")
            return super().__getitem__(i)

    loader = DataLoader(Fails(8, "torch", every=10**9), batch_size=8)
    with pytest.raises(KeyError) as raised:
        next(iter(loader))
    assert "sample index 4" in "".join(getattr(raised.value, "__notes__", []))


def test_seed_rngs_rejects_unknown_modes():
    assert [resolve_seed_rngs(v) for v in ("auto", True, False)] == ["auto", "always", "never"]
    with pytest.raises(ValueError, match="seed_rngs"):
        DataLoader(range(3), seed_rngs="sometimes")


def test_batch_seeds_equal_sample_seeds_for_every_kind_of_index():
    kinds = [
        [0, 5, -1, 2**63 - 1, -(2**63)],
        list(np.arange(10, dtype=np.int32)),
        np.arange(5, dtype=np.uint64),
        [True, False],
        [2**64 + 3, -(2**70)],
        ["a", ("b", 1)],
        [1.5, 2.0],
    ]
    for indices in kinds:
        assert batch_seeds(11, 2, indices) == [sample_seed(11, 2, i) for i in indices]


@pytest.mark.parametrize(
    "draw",
    [
        random.random,
        lambda: random.gauss(0, 1),
        np.random.rand,
        np.random.normal,
        lambda: torch.randn(1),
        lambda: torch.rand(1000),
    ],
)
def test_every_kind_of_draw_moves_a_fingerprint(draw):
    before = [fingerprint() for fingerprint in FINGERPRINTS]
    assert [fingerprint() for fingerprint in FINGERPRINTS] == before == all_fingerprints()
    draw()
    assert [fingerprint() for fingerprint in FINGERPRINTS] != before
    assert all_fingerprints() != before  # the one call an unseeded batch makes


class DrawsLate(Dataset):
    """Draws from NumPy's global RNG (``draw``) at index 5, only once ``late`` is set (after
    the probe)."""

    def __init__(self, draw=np.random.rand) -> None:
        self.draw = draw
        self.late = False

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        draw = float(self.draw()) if self.late and i == 5 else 0.0
        return torch.tensor([float(i), draw], dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:.*numpy.random")
def test_a_draw_from_a_bit_generator_installed_later_is_seen():
    # NOTE [ Fingerprints through views ]: the view of NumPy's words follows the generator
    # the training loop installs (a view of the old one would see no draw, and the sample
    # would be the unseeded one, not the contract's)
    expected_loader = DataLoader(DrawsLate(), batch_size=6, seed=4, seed_rngs="always")
    expected_loader.dataset.late = True
    expected = [list(expected_loader) for _ in range(2)][1]  # epoch 1
    dataset = DrawsLate()
    loader = DataLoader(dataset, batch_size=6, seed=4)
    list(loader)  # the probe: no draw seen, batches go unseeded
    previous = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.MT19937(8))
    try:
        dataset.late = True
        assert _same(list(loader), expected)
    finally:
        np.random.set_bit_generator(previous)


def test_state_readers_patched_between_batches_are_wrapped_and_put_back(monkeypatch):
    reads = StateReads()
    with reads:
        torch.get_rng_state()
    assert reads.read == [False, False, True]
    calls = []
    real = torch.get_rng_state

    def users_wrapper():
        calls.append(1)
        return real()

    monkeypatch.setattr(torch, "get_rng_state", users_wrapper)  # after the first batch
    with reads:
        assert reads.read == [False, False, False]
        torch.get_rng_state()
    assert reads.read == [False, False, True] and calls == [1]
    assert torch.get_rng_state is users_wrapper and torch.random.get_rng_state is real


def _scramble():
    np.random.seed(99)
    np.random.normal()  # a cached Gaussian that must not survive the restore
    random.seed(99)
    torch.manual_seed(99)


def _draws():
    return np.random.normal(), np.random.rand(), random.gauss(0, 1), float(torch.randn(1))


@pytest.mark.parametrize("pending_gaussian", [False, True])
def test_state_keeper_restores_exactly(pending_gaussian):
    keeper = StateKeeper()
    np.random.seed(5)
    random.seed(5)
    if pending_gaussian:
        np.random.normal()  # leaves one Gaussian cached
        random.gauss(0, 1)
    reference = keeper.save()
    expected = _draws()
    keeper.restore(reference)
    for _ in range(3):  # the second save of an unchanged state takes the cheap path
        states = keeper.save()
        _scramble()
        keeper.restore(states)
    assert _draws() == expected


def test_python_rng_state_is_read_in_place_on_cpython():
    import platform

    from fastloader.loader import rngs as _rngs

    if platform.python_implementation() == "CPython":
        assert _rngs._PYTHON_RAW  # else the getstate() fallback runs: correct, but slower
    random.seed(3)
    saved = _rngs._python_save()
    expected = random.random()
    random.seed(4)
    _rngs._python_restore(saved)
    assert random.random() == expected


class ReadsStates(SometimesDraws):
    """Reads torch's state without a net draw: initial_seed(), and a draw inside fork_rng."""

    def __getitem__(self, i):
        self.calls += 1
        with torch.random.fork_rng(devices=[]):
            restored = float(torch.rand(1))
        return torch.tensor([float(i), float(torch.initial_seed() % 2**40), restored])


def test_reading_a_state_without_drawing_is_seen_too():
    expected = _epochs(ReadsStates(20, "torch"), "always")
    assert _same(_epochs(ReadsStates(20, "torch"), "auto"), expected)
    assert _same(_epochs(ReadsStates(20, "torch"), "auto", num_workers=2), expected)
    # the recording wrappers are installed only while a batch loads
    assert torch.initial_seed.__module__ == "torch.random" and not hasattr(
        torch.initial_seed, "__wrapped__"
    )
    assert not hasattr(torch.get_rng_state, "__wrapped__")


def test_numpy_cached_gaussian_is_read_in_place():
    # NOTE [ NumPy's cached Gaussian without get_state ]: without it, unseeded batches are off
    from fastloader.loader import rngs as _rngs

    assert _rngs._NUMPY_AUG is not None and _rngs.fingerprints_see_everything()
    np.random.seed(11)
    np.random.normal()  # one Gaussian cached
    before = FINGERPRINTS[1]()
    np.random.normal()  # served from the cache: the Mersenne Twister's words do not move
    assert FINGERPRINTS[1]() != before


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_draw_from_the_training_loops_cached_gaussian_is_caught(mode):
    # The training loop leaves a Gaussian cached; an unseeded batch (NOTE [ Lazy seeding ])
    # that draws one would take it without moving the Mersenne Twister. It is caught: the
    # sample is the contract's, and the training loop still gets its own cached Gaussian.
    dataset = DrawsLate(np.random.normal)  # one Gaussian
    loader = DataLoader(dataset, batch_size=6, seed=4, seed_rngs=mode)
    list(loader)  # the probe: no draw seen
    dataset.late = True
    np.random.seed(21)
    np.random.normal()
    expected_next = np.random.normal()
    np.random.seed(21)
    np.random.normal()  # cached again
    if mode == "auto":
        with pytest.warns(RuntimeWarning, match="numpy.random"):
            batches = list(loader)
    else:
        batches = list(loader)
    assert np.random.normal() == expected_next  # the training loop's cached Gaussian
    np.random.seed(sample_seed(4, 1, 5) & 0xFFFFFFFF)
    assert batches[0][5, 1].item() == np.random.normal()


def test_state_readers_entered_from_two_threads_leave_the_originals_installed():
    # two loaders loading in the main process from two threads: each StateReads sees the
    # other's wrappers installed; whichever exits last, the module's own functions remain
    originals = (torch.get_rng_state, np.random.get_state, random.getstate)
    first, second = StateReads(), StateReads()
    for outer, inner in ((first, second), (second, first)):
        outer.__enter__()
        inner.__enter__()
        torch.get_rng_state()
        assert inner.read[2]  # the read is recorded by the reads entered last
        outer.__exit__(None, None, None)
        inner.__exit__(None, None, None)
        assert (torch.get_rng_state, np.random.get_state, random.getstate) == originals
    with first:
        np.random.get_state()
    assert first.read == [False, True, False]
    assert (torch.get_rng_state, np.random.get_state, random.getstate) == originals


class LoadsAnotherLoader(Dataset):
    """Iterates a loader of its own inside ``__getitem__`` (index 1 of each 4), then reads
    NumPy's state without drawing (index 2): the outer batch must still see that read."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        if i % 4 == 1:
            list(DataLoader(list(range(4)), batch_size=2, seed=1))
        value = float(np.random.get_state()[1][0]) if i % 4 == 2 else 0.0
        return torch.tensor([float(i), value], dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:.*numpy.random")
def test_a_loader_iterated_inside_a_sample_leaves_the_outer_reads_recorded():
    # NOTE [ One set of state-read wrappers ]: the inner loader's batch ends first; the outer
    # batch's later read is still seen, and the batch is the contract's
    expected = _epochs(LoadsAnotherLoader(), "always", epochs=3)
    assert _same(_epochs(LoadsAnotherLoader(), "auto", epochs=3), expected)
    outer, inner = StateReads(), StateReads()
    with outer:
        with inner:
            pass
        torch.initial_seed()
    assert outer.read == [False, False, True]


def test_a_mocked_state_reader_is_wrapped_like_any_function():
    with mock.patch("torch.initial_seed", return_value=0) as mocked:
        batches = list(DataLoader(list(range(4)), batch_size=2, seed=0))
        assert torch.initial_seed is mocked
    assert [batch.tolist() for batch in batches] == [[0, 1], [2, 3]]
    assert not hasattr(torch.initial_seed, "__wrapped__")


def test_a_process_forked_while_a_batch_loads_starts_without_the_wrappers():
    import os

    reads = StateReads()
    with reads:
        pid = os.fork()
        if pid == 0:  # the child: a worker started from a thread that was loading a batch
            clean = not hasattr(torch.get_rng_state, "__wrapped__")
            with StateReads():
                pass
            os._exit(0 if clean and not hasattr(torch.get_rng_state, "__wrapped__") else 1)
        _, status = os.waitpid(pid, 0)
        assert hasattr(torch.get_rng_state, "__wrapped__")  # the parent's batch goes on
    assert os.waitstatus_to_exitcode(status) == 0
    assert not hasattr(torch.get_rng_state, "__wrapped__")
