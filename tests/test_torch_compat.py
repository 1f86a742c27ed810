"""Drop-in behaviour a user switching from torch's DataLoader relies on (issue 11)."""

import math

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from fastloader import DataLoader


class AlwaysFails(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        raise NotImplementedError(f"sample {i}")


class FailsOnce(Dataset):
    """Sample 2 raises; the rest load."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        if i == 2:
            raise KeyError(i)
        return i


class InitialSeed(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return torch.initial_seed()


def _attempts(iterator) -> tuple[int, int]:
    batches = errors = 0
    while True:
        try:
            next(iterator)
            batches += 1
        except StopIteration:
            return batches, errors
        except (NotImplementedError, KeyError):
            errors += 1


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_an_epoch_ends_after_len_loader_attempts_even_when_every_batch_fails(
    num_workers, persistent
):
    loader = DataLoader(
        AlwaysFails(9),
        batch_size=2,
        shuffle=True,
        num_workers=num_workers,
        persistent_workers=persistent,
    )
    for _ in range(2):  # and the next epoch too (persistent workers prefetch across epochs)
        assert _attempts(iter(loader)) == (0, math.ceil(9 / 2))
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_caught_error_does_not_run_into_the_next_epoch(num_workers):
    loader = DataLoader(FailsOnce(), batch_size=2, num_workers=num_workers)
    for _ in range(3):
        assert _attempts(iter(loader)) == (3, 1)
    loader.close()


def test_torch_initial_seed_inside_workers_fits_in_int64_and_collates():
    loader = DataLoader(InitialSeed(), batch_size=8, num_workers=2, seed=2**64 - 1)
    for _ in range(2):
        seeds = torch.cat(list(loader))  # collating a Python int >= 2**63 would overflow
        assert seeds.dtype == torch.int64 and len(set(seeds.tolist())) == 64
        assert bool((seeds >= 0).all())
    loader.close()


def test_dataloader_is_generic_like_torchs():
    alias = DataLoader[list[torch.Tensor]]
    assert alias.__origin__ is DataLoader


def test_num_workers_errors_have_torchs_message_and_timing():
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        DataLoader(range(4), num_workers=-1)
    loader = DataLoader(range(4), num_workers=2.0)  # torch accepts it here, and fails later
    theirs = TorchDataLoader(range(4), num_workers=2.0)
    assert loader.num_workers == theirs.num_workers == 2.0
    with pytest.raises(TypeError):
        list(loader)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_building_a_loader_leaves_the_global_random_stream_as_torch_does(shuffle, num_workers):
    def model_after(loader_class):
        torch.manual_seed(0)
        loader_class(range(8), batch_size=2, shuffle=shuffle, num_workers=num_workers)
        return torch.nn.Linear(4, 4).weight.detach().clone()

    assert torch.equal(model_after(DataLoader), model_after(TorchDataLoader))


def test_default_seed_follows_torch_manual_seed_and_later_draws():
    torch.manual_seed(3)
    first = DataLoader(range(4)).seed
    torch.manual_seed(3)
    assert DataLoader(range(4)).seed == first
    torch.rand(1)  # a draw between two loaders gives the second another seed
    assert DataLoader(range(4)).seed != first


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_returns_torchs_iterator_with_its_surface(num_workers):
    loader = DataLoader(list(range(12)), batch_size=2, num_workers=num_workers)
    iterator = iter(loader)
    assert isinstance(iterator, _BaseDataLoaderIter)
    for name in ("_reset", "_num_yielded", "_sampler_iter", "_next_data", "_index_sampler"):
        assert hasattr(iterator, name), name
    assert len(iterator) == 6
    next(iterator), next(iterator)
    assert iterator._num_yielded == 2
    if num_workers:
        workers = iterator._workers
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        iterator._shutdown_workers()
        for worker in workers:
            worker.join(10)
            assert not worker.is_alive()
    loader.close()


def test_the_persistent_iterator_is_the_same_object_each_epoch_like_torchs():
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2)
    first = iter(loader)
    assert [b.tolist() for b in first] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    second = iter(loader)
    assert second is first and second._num_yielded == 0
    assert len(list(second)) == 4
    loader.close()


def _reseeds(worker_id):
    torch.manual_seed(1234 + worker_id)


def test_worker_init_fn_that_reseeds_warns_once_and_samples_keep_their_seeds():
    plain = DataLoader(InitialSeed(), batch_size=8, num_workers=2, seed=5)
    reference = [torch.cat(list(plain)) for _ in range(2)]
    plain.close()
    loader = DataLoader(
        InitialSeed(),
        batch_size=8,
        num_workers=2,
        seed=5,
        persistent_workers=False,
        worker_init_fn=_reseeds,
    )
    with pytest.warns(RuntimeWarning) as caught:
        for epoch in range(2):  # new workers every epoch, still one warning
            assert torch.equal(torch.cat(list(loader)), reference[epoch])
    messages = [str(w.message) for w in caught if "worker_init_fn" in str(w.message)]
    assert len(messages) == 1 and "seed=" in messages[0]


def test_worker_init_fn_that_leaves_the_rngs_alone_does_not_warn(recwarn):
    loader = DataLoader(InitialSeed(), batch_size=8, num_workers=2, worker_init_fn=print)
    list(loader)
    assert not [w for w in recwarn if "worker_init_fn" in str(w.message)]
    loader.close()


@pytest.mark.slow
def test_forkserver_workers_run_without_deaths(recwarn):
    loader = DataLoader(
        list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="forkserver"
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(loader.worker_pids) == 2
    assert not [w for w in recwarn if "DataLoader worker" in str(w.message)]
    loader.close()


class _Ragged(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        return torch.full((i + 1, 2), float(i))


def _nested(batch):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        return torch.nested.nested_tensor(batch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_of_nested_tensors_pass_through(num_workers):
    """torch's test_nested_tensor_multiprocessing: a nested tensor has no .shape to count."""
    loader = DataLoader(_Ragged(), batch_size=4, num_workers=num_workers, collate_fn=_nested)
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert [b.size(0) for b in batches] == [4, 4]
    assert [t.shape[0] for b in batches for t in b.unbind()] == list(range(1, 9))
    assert loader.stats.last.samples == 8


def test_an_iterdatapipe_is_sharded_across_workers_as_torch_shards_it():
    """torch's test_shuffler_iterdatapipe: each element once, with 0 or 2 workers."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataPipes are deprecated in torch
        from torch.utils.data.datapipes.iter import IterableWrapper

        datapipe = IterableWrapper(range(40)).shuffle().sharding_filter()
    for num_workers in (0, 2):
        loader = DataLoader(datapipe, batch_size=None, num_workers=num_workers)
        try:
            assert sorted(int(x) for x in loader) == list(range(40))
        finally:
            loader.close()


def test_without_workers_loader_iterator_stays_none_as_with_torch():
    loader = DataLoader(list(range(4)), batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert loader._iterator is None and TorchDataLoader(list(range(4)))._iterator is None
