"""One gather per column across a sharded pack's shards (NOTE [ One gather across shards ])."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastloader import DataLoader, ShardedDataset, open_pack, pack
from fastloader.datasets import shard_gather
from fastloader.datasets.collate import default_collate
from fastloader.formats import PackError


class Mixed:
    """Fixed fields (an int32 array, a raw image, an int) beside a string, read per shard:
    every value names its index."""

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int) -> dict:
        return {
            "x": np.full((16, 16), i, np.int32),
            "img": np.full((6, 5, 3), i % 251, np.uint8),
            "y": i,
            "name": f"s{i}",
        }


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def sharded(request, tmp_path_factory):
    target = tmp_path_factory.mktemp(request.param) / "pack"
    pack(Mixed(), target, shard_size="40KB", format=request.param, workers=0,
         schema={"img": "image"}, store="raw", progress=False)  # fmt: skip
    return target


def _batches(dataset, count: int = 6, size: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.permutation(len(dataset))[:size].tolist() for _ in range(count)]


def _expected(dataset, indices):
    return default_collate([dataset[i] for i in indices])


def _assert_same(got, want):
    assert list(got) == list(want)
    for name in want:
        if isinstance(want[name], torch.Tensor):
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        else:
            assert got[name] == want[name], name


@pytest.mark.parametrize("gather", ["numpy", "torch"])
@pytest.mark.parametrize("decode", ["numpy", "tensor"])
def test_a_batch_of_open_shards_is_the_samples_collated(sharded, monkeypatch, gather, decode):
    if gather == "torch":  # every row gathered whole by its offset, not in NumPy items
        monkeypatch.setattr(shard_gather, "_ITEMS_PER_ROW", 0)
    dataset = ShardedDataset(sharded, decode=decode)
    batches = _batches(dataset)
    assert len({dataset.shard_of(i) for i in batches[0]}) > 5
    for indices in batches:
        dataset.read_batch_columns(indices)  # opens the batch's shards: each shard made ready
    for indices in batches:
        columns = dataset.read_batch_columns(indices)
        assert type(columns.columns["x"]) is shard_gather.ScatteredRows  # one gather
        _assert_same(default_collate(columns), _expected(dataset, indices))
        samples = columns.samples()  # what a user's own collate would see
        assert [int(s["y"]) for s in samples] == indices
        assert [s["name"] for s in samples] == [f"s{i}" for i in indices]


def test_workers_gather_straight_into_their_slots(sharded):
    dataset = ShardedDataset(sharded)
    loader = DataLoader(dataset, batch_size=32, num_workers=2, shuffle=True, seed=3)
    with loader:
        for _ in range(2):  # the second epoch: every shard ready in both workers
            seen = list(loader)
            ys = torch.cat([b["y"] for b in seen])
            assert sorted(ys.tolist()) == list(range(300))
            for batch in seen:
                assert torch.equal(batch["x"][:, 3, 5], batch["y"].int())
                assert torch.equal(batch["img"][:, 2, 1, 0], (batch["y"] % 251).to(torch.uint8))
                assert batch["name"] == [f"s{i}" for i in batch["y"].tolist()]


def test_an_index_out_of_range_is_refused_once_shards_are_open(sharded):
    dataset = ShardedDataset(sharded)
    dataset.read_batch_columns([0, 299, 150])
    dataset.read_batch_columns([0, 299, 150])
    for bad in (300, -1):
        with pytest.raises(IndexError, match=f"index {bad} out of range"):
            dataset.read_batch_columns([0, bad, 150])


def test_shards_closed_and_opened_again_read_right(sharded):
    dataset = ShardedDataset(sharded, open_shards=2)  # most batches close a shard they read
    for indices in _batches(dataset, count=4, size=16) * 2:
        _assert_same(
            default_collate(dataset.read_batch_columns(indices)), _expected(dataset, indices)
        )
    assert len(dataset._open) <= 2


def test_a_batch_kept_after_its_shards_are_closed_still_holds_their_rows(sharded):
    dataset = ShardedDataset(sharded)
    indices = _batches(dataset, count=1)[0]
    dataset.read_batch_columns(indices)
    kept = dataset.read_batch_columns(indices)
    want = _expected(dataset, indices)
    dataset.close()  # every shard closed in this process: the batch keeps their maps
    _assert_same(default_collate(kept), want)


class Wide:
    """Rows of 16 KiB: blocks of 16 rows (NOTE [ Packs laid out by columns ]), a few a shard."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full((64, 64), i, np.int32), "y": i}


def test_a_damaged_block_is_refused_and_the_rest_of_its_shard_still_read(tmp_path):
    # a shard whose blocks do not all match their checksums when it is opened is left to the
    # per-shard path, which checks each block a batch reads: never made ready unchecked
    target = tmp_path / "pack"
    pack(Wide(), target, shard_size="800KB", format="lmdb", workers=0, progress=False)
    dataset = ShardedDataset(target)
    shard, first = dataset.manifest.shards[1], int(dataset._starts[1])
    assert shard.count >= 32
    path = target / shard.name
    reader = open_pack(path)
    file_start = np.frombuffer(reader._handle.view, np.uint8).ctypes.data
    at = reader.column_table().columns[0].rows[0][20].ctypes.data - file_start  # row 20's x
    reader.close()
    data = bytearray(path.read_bytes())
    assert data[at : at + 4] == np.int32(first + 20).tobytes()
    data[at + 7] ^= 0xFF
    path.write_bytes(data)
    dataset = ShardedDataset(target)
    undamaged = [first + 1, first + 2, *range(first + shard.count, first + shard.count + 30)]
    for _ in range(2):
        _assert_same(
            default_collate(dataset.read_batch_columns(undamaged)), _expected(dataset, undamaged)
        )
        with pytest.raises(PackError, match=f"{shard.name}: damaged field 'x' rows 16-31"):
            dataset.read_batch_columns([*undamaged, first + 20])


class Pages:
    """Rows of exactly one memory page (4096 uint8): in an LMDB shard each lies whole pages
    from the map's start, so a gather's rows share one alignment."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full(4096, i % 251, np.uint8), "y": i}


def test_a_batch_tensor_is_placed_at_its_rows_alignment_and_holds_them(tmp_path):
    # NOTE [ Gathered into the batch tensor ] (collate.py): a batch tensor whose address is
    # just past its source rows' modulo a page slows every row's copy (4K aliasing), so it is
    # moved to their alignment: for rows of one pack and for rows of many shards alike
    from fastloader.datasets.collate import _ALIASED, _whole_tensor
    from fastloader.formats.mapped_rows import PAGE

    one = open_pack(_pack(tmp_path / "one.lmdb", None))
    shards = ShardedDataset(_pack(tmp_path / "shards", "60KB"))
    indices = list(range(59, -1, -3))
    shards.read_batch_columns(indices)  # opens (and checks) the shards: then gathered at once
    for dataset in (one, shards):
        column = dataset.read_batch_columns(indices).columns["x"]
        source = column.source_address()
        assert source is not None
        assert {address % PAGE for address in _row_addresses(column)} == {source % PAGE}
        tensor = _whole_tensor(column)
        assert not 0 < (tensor.data_ptr() - source) % PAGE < _ALIASED
        assert tensor[:, 0].tolist() == [i % 251 for i in indices]
    assert isinstance(column, shard_gather.ScatteredRows) and len(shards.manifest.shards) > 2


def _pack(target, shard_size):
    pack(Pages(), target, shard_size=shard_size, workers=0, progress=False)
    return target


def _row_addresses(column) -> list[int]:
    """Where each row of ``column`` (rows not gathered yet) lies in memory."""
    if isinstance(column, shard_gather.ScatteredRows):
        memory = column.memory  # items of memory.unit bytes from memory.low
        return [memory.low + int(item) * memory.unit for item in column.items[:, 0]]
    first = column.source.__array_interface__["data"][0]
    return [first + int(row) * column.source[:1].nbytes for row in column.rows]
