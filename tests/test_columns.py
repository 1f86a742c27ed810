"""Users' HDF5 batches read by columns for the default collate (NOTE [ Batches read by columns ]):
the same batch, exactly, as collating the samples, in the main process and through workers."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import Subset, random_split

from fastloader import DataLoader, HDF5Dataset
from fastloader.datasets.collate import default_collate
from fastloader.datasets.columns import ColumnBatch
from fastloader.datasets.users_files import HDF5FileDataset
from fastloader.loader.iterators.worker_pool import WorkerPoolIter
from tests._batches import assert_same_batch

COUNT = 20
BATCHES = [[3, 1, 4, 1, 5], [9, 2, 6], [0], [5, 3, 5, 8, 9, 7, 9, 19], [-1, 10]]


@pytest.fixture
def every_kind(tmp_path):
    """One field of each kind a user's file gives: arrays (mapped, big-endian, chunked, empty
    rows), numbers of three types, strings (variable, fixed, two per row)."""
    rng = np.random.default_rng(3)
    path = tmp_path / "kinds.h5"
    with h5py.File(path, "w") as file:
        file["image"] = rng.integers(0, 256, (COUNT, 6, 5, 3), np.uint8)
        file["part"] = rng.random((COUNT, 14, 2), np.float32)
        file["big"] = rng.random((COUNT, 3)).astype(">f4")
        file["none"] = np.zeros((COUNT, 0), np.float32)  # rows of no value
        file["label"] = rng.integers(-5, 1000, COUNT)
        file["score"] = rng.random(COUNT, np.float32)
        file["flag"] = rng.random(COUNT) > 0.5
        file.create_dataset(
            "name", data=[f"n{i}_é" for i in range(COUNT)], dtype=h5py.string_dtype()
        )
        file["fixed"] = np.array([f"f{i}".encode() for i in range(COUNT)], "S8")
        file["pair"] = np.array([[f"a{i}".encode(), f"b{i}".encode()] for i in range(COUNT)], "S4")
        file.create_dataset(
            "visible", data=rng.random((COUNT, 14)) > 0.5, chunks=(4, 14), compression="gzip"
        )
    return path


def reference(dataset, batches):
    """Each batch as the samples' default collate gives it (the contract)."""
    return [default_collate(dataset.read_many(batch)) for batch in batches]


@pytest.mark.parametrize("workers, slots", [(0, True), (2, True), (2, False)])
def test_batches_read_by_columns_equal_the_samples_collated(
    every_kind, workers, slots, monkeypatch
):
    monkeypatch.setattr(WorkerPoolIter, "slots", slots)  # False: torch's transport in workers
    dataset = HDF5Dataset(every_kind)
    loader = DataLoader(dataset, batch_sampler=BATCHES, num_workers=workers)
    got = list(loader)
    for at, (batch, want) in enumerate(zip(got, reference(dataset, BATCHES), strict=True)):
        assert_same_batch(batch, want, f"batch {at}")
    assert got[0]["score"].dtype == torch.float64  # numbers collate as Python numbers do
    pairs = [list(strings) for strings in got[0]["pair"]]  # torch's collate: per position
    assert pairs == [["a3", "a1", "a4", "a1", "a5"], ["b3", "b1", "b4", "b1", "b5"]]


def test_the_main_process_reads_columns_and_a_users_collate_still_gets_samples(
    every_kind, monkeypatch
):
    dataset = HDF5Dataset(every_kind)
    calls = []
    read = HDF5FileDataset.read_batch_columns

    def counted(self, indices):
        calls.append(list(indices))
        return read(self, indices)

    monkeypatch.setattr(HDF5FileDataset, "read_batch_columns", counted)
    list(DataLoader(dataset, batch_sampler=BATCHES))
    assert calls == [[index % COUNT for index in batch] for batch in BATCHES] or calls == BATCHES
    calls.clear()
    seen = []
    list(DataLoader(dataset, batch_sampler=BATCHES, collate_fn=seen.append))
    assert calls == []  # a collate_fn of the user's own: the samples, as always
    assert all(type(batch) is list and type(batch[0]) is dict for batch in seen)
    assert len(seen[3]) == 8


def test_transformed_or_tuple_samples_are_not_read_by_columns(every_kind):
    assert HDF5Dataset(every_kind, transform=lambda sample: sample).read_batch_columns([1]) is None
    tuples = HDF5Dataset(every_kind, fields=["part", "label"], as_tuple=True)
    assert tuples.read_batch_columns([1]) is None
    assert HDF5Dataset(every_kind).read_batch_columns([]) is None
    batch = next(iter(DataLoader(tuples, batch_sampler=BATCHES)))
    assert type(batch) is list and batch[1].tolist() == [tuples[i][1] for i in BATCHES[0]]


@pytest.mark.parametrize("workers", [0, 2])
def test_subsets_read_by_columns_give_the_subsets_samples(every_kind, workers):
    dataset = HDF5Dataset(every_kind)
    part, _ = random_split(dataset, [12, 8], generator=torch.Generator().manual_seed(4))
    nested = Subset(part, [11, 0, 5, 5, 7, 2])
    got = list(DataLoader(nested, batch_size=4, num_workers=workers))
    rows = [part.indices[index] for index in nested.indices]
    assert_same_batch(got, reference(dataset, [rows[:4], rows[4:]]))


def test_a_column_that_does_not_collate_raises_the_samples_error(tmp_path):
    path = tmp_path / "compound.h5"
    record = np.dtype([("x", "<f4"), ("y", "<i2")])
    with h5py.File(path, "w") as file:
        file["rec"] = np.zeros(6, record)
        file["label"] = np.arange(6)
    dataset = HDF5Dataset(path)
    with pytest.raises(TypeError) as samples_error:
        default_collate(dataset.read_many([0, 1]))
    batch = dataset.read_batch_columns([0, 1])
    assert type(batch) is ColumnBatch and len(batch) == 2
    with pytest.raises(TypeError) as columns_error:
        default_collate(batch)
    assert str(columns_error.value) == str(samples_error.value)
    with DataLoader(dataset, batch_size=2, num_workers=1) as loader:  # its worker stopped here
        with pytest.raises(TypeError, match=str(samples_error.value)[:40]):
            list(loader)


class WithArea(HDF5FileDataset):
    """A user's subclass that adds a field per sample."""

    def read_many(self, indices):
        samples = super().read_many(indices)
        for sample in samples:
            sample["area"] = float(sample["part"].sum())
        return samples


class Renamed(HDF5FileDataset):
    """A subclass that changes nothing about its samples: still read by columns."""

    note = "mine"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subclass_that_reads_its_own_way_gets_its_own_samples(every_kind, workers):
    dataset = WithArea(every_kind)
    assert dataset.read_batch_columns([1, 2]) is None
    got = list(DataLoader(dataset, batch_sampler=BATCHES, num_workers=workers))
    assert_same_batch(got, reference(dataset, BATCHES))
    assert got[0]["area"].dtype == torch.float64
    assert type(Renamed(every_kind).read_batch_columns([1, 2])) is ColumnBatch
