"""fastloader.DataLoader(device=..., device_transform=...): batches arrive on the device."""

import pytest
import torch
from _datasets import RandomDraws

from fastloader import DataLoader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _double_values(batch):
    values, pids = batch
    return values * 2, pids


def _values(loader, epochs=2):
    return [[values.cpu() for values, _ in loader] for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_cpu_gives_the_same_batches_as_no_device(num_workers):
    plain = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, seed=3, num_workers=num_workers)
    on_cpu = DataLoader(
        RandomDraws(12),
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=num_workers,
        device="cpu",
        device_prefetch=3,
    )
    with plain, on_cpu:
        expected, got = _values(plain), _values(on_cpu)
    for epoch_expected, epoch_got in zip(expected, got, strict=True):
        assert len(epoch_got) == 3
        for a, b in zip(epoch_expected, epoch_got, strict=True):
            assert torch.equal(a, b)


def test_device_transform_runs_on_every_batch_and_stats_count_them():
    loader = DataLoader(
        RandomDraws(10), batch_size=4, seed=1, device="cpu", device_transform=_double_values
    )
    plain = DataLoader(RandomDraws(10), batch_size=4, seed=1)
    for (doubled, _), (values, _) in zip(loader, plain, strict=True):
        assert torch.equal(doubled, values * 2)
    assert loader.stats.last.batches == 3 and loader.stats.last.samples == 10


def test_device_none_changes_nothing():
    loader = DataLoader(RandomDraws(8), batch_size=4)
    assert loader.device is None and loader.pin_memory is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_fails_at_construction():
    with pytest.raises(RuntimeError, match="CUDA"):
        DataLoader(RandomDraws(8), batch_size=4, device="cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_loader_batches_equal_the_cpu_batches(num_workers):
    cpu = DataLoader(RandomDraws(16), batch_size=4, shuffle=True, seed=2, num_workers=num_workers)
    cuda = DataLoader(
        RandomDraws(16),
        batch_size=4,
        shuffle=True,
        seed=2,
        num_workers=num_workers,
        device="cuda",
        device_transform=_double_values,
    )
    assert cuda.pin_memory is True
    with cpu, cuda:
        for (values, _), (on_device, _) in zip(cpu, cuda, strict=True):
            assert on_device.is_cuda
            assert torch.equal(on_device.cpu(), values * 2)
