"""Set-ups that would go unnoticed: an epoch that yields no batch is named once, with its cause
(NOTE [ Empty epochs ]); arguments that cannot take effect are refused or named at construction
(NOTE [ Arguments that cannot take effect ])."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset

from fastloader import DataLoader
from fastloader.loader.setup_warnings import (
    EmptyEpochWarning,
    IneffectiveArgumentWarning,
    warn_if_empty_epoch,
)


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


# NOTE [ Arguments that cannot take effect ]: each is refused or named at construction.


def _normalise(batch):
    return batch


def test_device_transform_without_device_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"device_transform=.*device= is not set"):
        DataLoader(_data(8), batch_size=4, device_transform=_normalise)
    with pytest.raises(TypeError, match="device_transform must be callable"):
        DataLoader(_data(8), batch_size=4, device="cpu", device_transform="normalise")
    loader = DataLoader(_data(8), batch_size=4, device="cpu", device_transform=_normalise)
    assert loader.device_transform is _normalise  # with a device it is taken


def test_device_prefetch_without_device_is_named() -> None:
    with pytest.warns(IneffectiveArgumentWarning, match="device_prefetch=4 has no effect"):
        DataLoader(_data(8), batch_size=4, device_prefetch=4)


def test_pin_memory_with_device_cpu_is_named() -> None:
    with pytest.warns(IneffectiveArgumentWarning, match="pin_memory=True has no effect with dev"):
        DataLoader(_data(8), batch_size=4, pin_memory=True, device="cpu")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks a machine without a GPU")
def test_pin_memory_without_an_accelerator_is_named_at_construction() -> None:
    with pytest.warns(IneffectiveArgumentWarning, match="no GPU"):
        DataLoader(_data(8), batch_size=4, pin_memory=True)


def test_arguments_that_take_effect_warn_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataLoader(_data(8), batch_size=4)
        DataLoader(_data(8), batch_size=4, device="cpu", device_prefetch=3)
        DataLoader(_data(8), batch_size=4, pin_memory=False, device_prefetch=2)
        if torch.accelerator.is_available():
            DataLoader(_data(8), batch_size=4, pin_memory=True)


def test_shuffle_on_a_mix_is_named_once_with_the_reason() -> None:
    from fastloader import Mix
    from fastloader.loader.setup_warnings import warn_if_shuffle_on_mix

    mix = Mix({"a": _data(10), "b": _data(5)}, seed=1)
    with pytest.warns(IneffectiveArgumentWarning, match=r"shuffle=True has no effect on a Mix"):
        loader = DataLoader(mix, batch_size=5, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read = [(batch.source, batch.index.tolist()) for batch in loader]  # no more warnings
        plain = DataLoader(mix, batch_size=5)
        assert read == [(batch.source, batch.index.tolist()) for batch in plain]  # mix's order
        warn_if_shuffle_on_mix(True, True, mix)  # it picks padding
    with pytest.warns(IneffectiveArgumentWarning, match=r"this one reads each source in order"):
        DataLoader(Mix({"a": _data(10)}, shuffle=False), batch_size=5, shuffle=True)
