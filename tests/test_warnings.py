"""An epoch that yields no batch is named once, with its cause (NOTE [ Empty epochs ])."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset

from fastloader import DataLoader
from fastloader.loader.setup_warnings import EmptyEpochWarning, warn_if_empty_epoch


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def test_drop_last_with_a_batch_larger_than_the_data_is_named_once() -> None:
    loader = DataLoader(_data(10), batch_size=16, drop_last=True)
    with pytest.warns(EmptyEpochWarning, match=r"10 samples.*batch_size=16.*drop_last=False"):
        assert len(list(loader)) == 0  # the epoch itself says so
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader)) == 0  # once per loader
        assert not warn_if_empty_epoch(loader, 0)
    other = DataLoader(_data(10), batch_size=16, drop_last=True)
    with pytest.warns(EmptyEpochWarning):
        warn_if_empty_epoch(other, 0)


def test_a_ranks_share_smaller_than_the_batch_names_the_ranks() -> None:
    sampler = DistributedSampler(_data(20), num_replicas=4, rank=0, shuffle=False)
    loader = DataLoader(_data(20), batch_size=8, sampler=sampler, drop_last=True)
    with pytest.warns(EmptyEpochWarning, match=r"20 samples \(5 per rank over 4 ranks\)"):
        warn_if_empty_epoch(loader, 0)


def test_an_empty_dataset_and_an_empty_stream_are_named() -> None:
    with pytest.warns(EmptyEpochWarning, match="the dataset is empty"):
        warn_if_empty_epoch(DataLoader(_data(0), batch_size=4), 0)

    class Nothing(IterableDataset):
        def __iter__(self):
            return iter(())

    with pytest.warns(EmptyEpochWarning, match="iterable dataset yielded no sample"):
        warn_if_empty_epoch(DataLoader(Nothing(), batch_size=4), 0)


def test_epochs_with_batches_and_resumes_at_the_end_are_not_warned() -> None:
    loader = DataLoader(_data(10), batch_size=16, drop_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_empty_epoch(loader, 3)
        assert not warn_if_empty_epoch(loader, 0, resumed_at_end=True)


def test_an_empty_epoch_of_a_worker_pool_is_named_too() -> None:
    loader = DataLoader(_data(10), batch_size=16, drop_last=True, num_workers=2)
    try:
        with pytest.warns(EmptyEpochWarning, match="drop_last=True"):
            assert list(loader) == []
    finally:
        loader.close()
