"""A user's own sampler.set_epoch(e) wins over the loader's epoch counter (the DDP idiom)."""

import numpy as np
import pytest
import torch
from _datasets import RandomDraws

from fastloader import DataLoader


def _indices(loader):
    return [int(i) for values, _ in loader for i in values[:, 0]]


def _reference_order(epoch):
    reference = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=2)
    reference.set_epoch(epoch)
    return _indices(reference)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_user_set_epoch_on_the_shuffle_sampler_wins_and_the_loader_follows(num_workers):
    loader = DataLoader(
        RandomDraws(12), batch_size=4, shuffle=True, seed=2, num_workers=num_workers
    )
    for epoch in (5, 6, 7):  # the user's counter, starting at 5 as after a resume
        loader.sampler.set_epoch(epoch)
        assert _indices(loader) == _reference_order(epoch)
        assert loader.epoch == epoch
    assert _indices(loader) == _reference_order(8)  # without a call: the next epoch
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_repeating_set_epoch_repeats_the_order_as_with_torch(num_workers):
    dataset = list(range(16))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1, seed=4)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=num_workers)
    orders = []
    for _ in range(3):
        sampler.set_epoch(3)
        orders.append([int(i) for batch in loader for i in batch])
    torch_sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1, seed=4)
    torch_sampler.set_epoch(3)
    assert orders == [list(torch_sampler)] * 3
    assert loader.epoch == 3
    loader.close()


def test_set_epoch_called_before_the_loader_was_made_is_kept():
    dataset = list(range(16))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, seed=4)
    sampler.set_epoch(9)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    expected = list(sampler)
    assert next(iter(loader)).tolist() == expected and loader.epoch == 9


def test_after_a_resume_the_same_epoch_keeps_the_position_and_another_starts_afresh():
    first = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=2)
    first.set_epoch(5)
    iterator = iter(first)
    head = [int(i) for i in next(iterator)[0][:, 0]]
    state = first.state_dict()

    resumed = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(5)  # the idiom: for epoch in range(start, n): set_epoch(epoch)
    assert head + _indices(resumed) == _reference_order(5)

    jumped = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=2)
    jumped.load_state_dict(state)
    jumped.sampler.set_epoch(6)
    assert _indices(jumped) == _reference_order(6) and jumped.epoch == 6


def test_the_last_of_loader_set_epoch_and_sampler_set_epoch_wins():
    loader = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=2)
    loader.sampler.set_epoch(4)
    loader.set_epoch(2)
    assert _indices(loader) == _reference_order(2)
    loader.set_epoch(2)
    loader.sampler.set_epoch(4)
    assert _indices(loader) == _reference_order(4)


def test_a_numpy_epoch_is_accepted_and_a_negative_one_is_refused():
    loader = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=2)
    loader.sampler.set_epoch(np.int64(3))
    assert _indices(loader) == _reference_order(3) and loader.epoch == 3
    loader.sampler.set_epoch(-1)
    with pytest.raises(ValueError, match="non-negative"):
        iter(loader)
