"""Batches in flight per worker from the first batch's bytes when ``prefetch_factor`` is unset
(NOTE [ Prefetch depth by batch bytes ])."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from fastloader import DataLoader
from fastloader.loader.prefetch_depth import MAX_DEPTH, PREFETCH_BYTES, batch_bytes, prefetch_depth


class Arrays(Dataset):
    """Sample i: a float32 tensor of ``size`` values, all i."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.full((self.size,), float(index)), "i": index}


def test_the_depth_follows_the_bytes_of_a_batch():
    class Batch:  # tensors inside an object of the user's: not seen, torch's depth kept
        def __init__(self):
            self.x = torch.zeros(PREFETCH_BYTES, dtype=torch.uint8)

    assert prefetch_depth(Batch()) == 2
    assert prefetch_depth(collections.UserDict(x=torch.zeros(PREFETCH_BYTES // 2))) == 2
    small = {"x": torch.zeros(64, 100), "names": ["a"] * 64, "y": np.zeros(64)}
    assert batch_bytes(small) == 64 * 100 * 4 + 64 * 8
    assert prefetch_depth(small) == MAX_DEPTH
    assert prefetch_depth([torch.zeros(PREFETCH_BYTES // 3, dtype=torch.uint8)]) == 3
    assert prefetch_depth(torch.zeros(PREFETCH_BYTES, dtype=torch.uint8)) == 2  # torch's
    assert prefetch_depth(("no", "arrays")) == 2


@pytest.mark.parametrize(
    ("size", "given", "depth"),
    [
        (16, None, MAX_DEPTH),
        pytest.param(PREFETCH_BYTES // 4 // 4, None, 2, marks=pytest.mark.slow),
        (16, 3, 3),
    ],
)
def test_workers_keep_the_depth_in_flight_and_every_batch_in_order(size, given, depth):
    def loader(workers):
        return DataLoader(
            Arrays(64, size),
            batch_size=4,
            shuffle=True,
            seed=3,
            num_workers=workers,
            prefetch_factor=given if workers else None,
        )

    pooled, reference = loader(2), loader(0)
    for _ in range(2):  # the second epoch: tasks sent ahead at the deeper depth
        got, want = list(pooled), list(reference)
        assert pooled._iterator._prefetch_factor == depth
        assert [b["i"].tolist() for b in got] == [b["i"].tolist() for b in want]
        assert all(torch.equal(g["x"], w["x"]) for g, w in zip(got, want, strict=True))
    assert pooled.prefetch_factor == (2 if given is None else given)  # torch's attribute


def test_after_a_jump_back_tasks_go_one_epoch_past_it_at_most():
    loader = DataLoader(Arrays(3, 4), batch_size=1, num_workers=2, seed=0)
    for _ in range(6):  # 3 batches an epoch, up to 16 in flight
        list(loader)
    loader.set_epoch(1)
    batches = list(loader)
    iterator = loader._iterator
    assert iterator._prefetch_factor == MAX_DEPTH
    assert iterator._schedule.epoch <= 2  # sent while epoch 1 ran: epoch 2 at most
    assert sorted(int(b["i"]) for b in batches) == [0, 1, 2]
