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


def _twins(samples, seed, num_workers, **device_arguments):
    """Two loaders of the same shuffled batches: one without ``device_arguments``, one with."""

    def loader(**extra):
        draws = RandomDraws(samples)
        return DataLoader(
            draws, batch_size=4, shuffle=True, seed=seed, num_workers=num_workers, **extra
        )

    return loader(), loader(**device_arguments)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_cpu_gives_the_same_batches_as_no_device(num_workers):
    plain, on_cpu = _twins(12, 3, num_workers, device="cpu", device_prefetch=3)
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
    cpu, cuda = _twins(16, 2, num_workers, device="cuda", device_transform=_double_values)
    assert cuda.pin_memory is True
    with cpu, cuda:
        for (values, _), (on_device, _) in zip(cpu, cuda, strict=True):
            assert on_device.is_cuda
            assert torch.equal(on_device.cpu(), values * 2)


class _FailsAt(torch.utils.data.Dataset):
    """Yields its index; raises at the indices in ``bad``."""

    def __init__(self, length, bad):
        self.length, self.bad = length, set(bad)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if index in self.bad:
            raise ValueError(f"bad sample {index}")
        return index


def _events(loader, stop_at_error=False):
    """First sample of each batch, "ERR" for a raised batch; stops after an error if asked."""
    events, iterator = [], iter(loader)
    while True:
        try:
            events.append(int(next(iterator)[0]))
        except StopIteration:
            return events
        except ValueError:
            events.append("ERR")
            if stop_at_error:
                return events


# errors near the start, mid-epoch, and within the prefetch depth of the end
@pytest.mark.parametrize("bad", [(21,), (1, 13), (37,), (30, 38)])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_keeps_a_batch_error_in_its_place_and_resume_after_it_is_exact(num_workers, bad):
    def make(**device):
        return DataLoader(_FailsAt(40, bad), batch_size=4, num_workers=num_workers, **device)

    with make() as plain, make(device="cpu", device_prefetch=2) as on_cpu:
        expected = _events(plain)
        assert _events(on_cpu) == expected
    assert expected.count("ERR") == len({index // 4 for index in bad})

    # a user who checkpoints on the first error resumes at exactly the next batch
    with make(device="cpu") as first:
        seen = _events(first, stop_at_error=True)
        state = first.state_dict()
    assert seen == expected[: len(seen)] and seen[-1] == "ERR"
    assert state["position"] == 4 * len(seen)
    with make(device="cpu") as resumed:
        resumed.load_state_dict(state)
        assert _events(resumed) == expected[len(seen) :]
