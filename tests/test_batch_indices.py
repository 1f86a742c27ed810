"""``loader.last_indices`` names the samples of the batch just handed out (NOTE [ Indices of a
batch ]): with workers, batches several to a message, a resume, distributed order, a Mix, a
weight change, an early break, a failed batch and ``device=``; refused where there is no order.
"""

import json

import pytest
from _datasets import CountingStream, FailsAt
from torch.utils.data import BatchSampler, Dataset, SequentialSampler

from fastloader import DataLoader, Mix
from fastloader.loader.transport import groups
from fastloader.sampling.distributed import ElasticDistributedSampler


class Indexed(Dataset):
    """Sample i is i: a batch says which samples it holds, to check ``last_indices`` against."""

    def __init__(self, n: int = 300) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def checked(loader, steps=None) -> list[list[int]]:
    """The epoch's batches (up to ``steps``), each checked against ``last_indices``."""
    batches = []
    for batch in loader:
        assert loader.last_indices == batch.tolist()
        batches.append(batch.tolist())
        if len(batches) == steps:
            break
    return batches


@pytest.mark.parametrize("workers", [0, 2])
def test_each_batch_names_its_samples_across_epochs(workers):
    with DataLoader(Indexed(), batch_size=8, shuffle=True, seed=4, num_workers=workers) as loader:
        assert loader.last_indices is None
        epochs = [checked(loader) for _ in range(3)]  # workers load the next epoch ahead
    assert epochs[0] != epochs[1]
    assert all(sorted(i for batch in epoch for i in batch) == list(range(300)) for epoch in epochs)


def test_batches_travelling_several_to_a_message_each_name_their_own(monkeypatch):
    monkeypatch.setattr(groups, "MESSAGE_S", 10.0)  # groups of MAX_GROUP form on any machine
    with DataLoader(Indexed(800), batch_size=4, shuffle=True, seed=4, num_workers=2) as loader:
        for _ in range(2):
            checked(loader)
        assert loader._iterator._groups.size == groups.MAX_GROUP


def test_an_epoch_left_early_does_not_shift_the_next_ones_indices():
    with DataLoader(Indexed(), batch_size=8, shuffle=True, seed=4, num_workers=2) as loader:
        checked(loader, steps=5)  # the batches in flight are drained at the next iter()
        whole = checked(loader)
    assert len(whole) == 38


def test_a_resumed_loader_names_the_batches_still_due():
    def loader(batch_size, workers):
        return DataLoader(
            Indexed(), batch_size=batch_size, shuffle=True, seed=4, num_workers=workers
        )

    with loader(8, 2) as first:
        seen = checked(first, steps=6)
        state = json.loads(json.dumps(first.state_dict()))
    with loader(5, 2) as resumed:  # another batch size and worker count
        resumed.load_state_dict(state)
        rest = checked(resumed)
    assert [i for b in seen + rest for i in b] == [i for b in checked(loader(8, 0)) for i in b]


def test_distributed_order_names_this_ranks_samples_and_resumes_on_another_world_size():
    def rank_loader(rank, world):  # what distributed=True builds, without a process group
        sampler = ElasticDistributedSampler(Indexed(), 4, num_replicas=world, rank=rank, seed=4)
        return DataLoader(Indexed(), 4, sampler=sampler, distributed=True)

    two = [rank_loader(rank, 2) for rank in range(2)]
    steps = [checked(loader, steps=10) for loader in two]
    state = json.loads(json.dumps(two[0].state_dict()))
    three = [rank_loader(rank, 3) for rank in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    rest = [checked(loader) for loader in three]
    taken = [i for rank in steps + rest for batch in rank for i in batch]
    assert sorted(taken) == list(range(300))  # every sample once
    for loader in two + three:
        loader.close()


def test_a_mix_names_the_source_and_index_of_each_sample():
    sources = {"a": Indexed(100), "b": Indexed(60)}
    mix = Mix(sources, weights={"a": 0.5, "b": 0.5})
    with DataLoader(mix, batch_size=10, seed=4, num_workers=2) as loader:
        for step, batch in enumerate(loader):
            pairs = list(zip(batch.source, batch.index.tolist(), strict=True))
            assert loader.last_indices == pairs
            assert batch.sample.tolist() == batch.index.tolist()
            if step == 3:  # a weight change reloads what was loaded ahead
                loader.dataset.set_weights({"a": 0.0, "b": 1.0})
        assert {source for source, _ in loader.last_indices} == {"b"}


def test_the_batch_whose_loading_raised_is_the_one_named():
    loader = DataLoader(FailsAt(bad=5, n=12), batch_size=2, num_workers=2)
    named = []
    iterator = iter(loader)
    for _ in range(6):
        try:
            next(iterator)
        except ValueError:
            named.append(loader.last_indices)
    assert named == [[4, 5]]
    assert loader.last_indices == [10, 11]
    loader.close()


def test_one_index_without_batches_and_a_users_batch_sampler_own_lists():
    loader = DataLoader(Indexed(5), batch_size=None)
    assert [(item, loader.last_indices) for item in loader] == [(i, i) for i in range(5)]
    pairs = BatchSampler(SequentialSampler(range(7)), 3, drop_last=False)
    loader = DataLoader(Indexed(7), batch_sampler=pairs)
    assert checked(loader) == [[0, 1, 2], [3, 4, 5], [6]]


def test_batches_copied_to_the_device_ahead_name_their_own():
    loader = DataLoader(Indexed(), batch_size=8, shuffle=True, seed=4, device="cpu")
    assert len(checked(loader)) == 38  # 2 batches copied ahead of the one handed out


def test_no_indices_without_an_order_raises_naming_why():
    with pytest.raises(ValueError, match="IterableDataset has no indices"):
        DataLoader(CountingStream(), batch_size=2).last_indices  # noqa: B018
    loader = DataLoader(Indexed(), batch_size=8, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match="in_order=True"):
        loader.last_indices  # noqa: B018
    alone = DataLoader(Indexed(), batch_size=8, in_order=False)  # one process: in order
    assert next(iter(alone)).tolist() == alone.last_indices == list(range(8))
