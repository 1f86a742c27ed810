"""Packs laid out by columns (format 5): whole batches by column, checksums per block of rows.

NOTE [ Packs laid out by columns ] in fastloader/formats/column_layout.py; NOTE [ Blocks checked
once per process ] in column_reader.py; NOTE [ One meaning per argument ] in
datasets/field_samples.py.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import fastloader
from fastloader import DataLoader, HDF5Dataset, LMDBDataset, PackError, pack, read_metadata
from fastloader.datasets.columns import ColumnBatch
from fastloader.formats import column_layout, column_reader
from fastloader.formats.hdf5_foreign import HDF5File
from fastloader.formats.info import describe
from tests._fields import POSE_FIELDS, Detection, assert_same_sample, h5py_rows

OPEN = {".lmdb": LMDBDataset, ".h5": HDF5Dataset}


@pytest.fixture(params=[".lmdb", ".h5"])
def suffix(request):
    return request.param


@pytest.fixture
def pose(tmp_path):
    """The pose file of tests/_fields.py with 64x64 images: blocks of 16 rows."""
    path = tmp_path / "source.h5"
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as file:
        file.create_dataset("image", data=rng.integers(0, 256, (70, 64, 64, 3), np.uint8))
        file.create_dataset("part", data=rng.random((70, 14, 2), np.float32) * 100)
        file.create_dataset("S", data=rng.random((70, 14, 3)))
        names = [f"im{index:05d}_é.jpg" for index in range(70)]
        file.create_dataset("imagename", data=names, dtype=h5py.string_dtype())
    return path


def _assert_same_batch(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def test_a_pack_of_a_users_file_reads_back_as_the_file_does(pose, tmp_path, suffix):
    path = tmp_path / f"pose{suffix}"
    pack(pose, path, workers=0)
    assert read_metadata(path)["version"] == 5
    # the data itself, plus a few pages (LMDB's tree and meta pages): no per-sample overhead
    assert path.stat().st_size <= 1.1 * pose.stat().st_size + (48 << 10)
    packed, in_place = OPEN[suffix](path), HDF5Dataset(pose)  # the same line, both files
    assert packed.layout == "columns"
    for index in (0, 33, 69, -1):
        assert_same_sample(packed[index], in_place[index])
    for workers in (0, 2):
        loaders = [
            DataLoader(dataset, batch_size=16, shuffle=True, seed=5, num_workers=workers)
            for dataset in (packed, in_place)
        ]
        for got, want in zip(*loaders, strict=True):
            _assert_same_batch(got, want)


def test_raw_images_come_back_as_arrays_by_default_and_pil_when_asked(pose, tmp_path, suffix):
    path = tmp_path / f"pose{suffix}"
    pack(HDF5File(pose), path, schema={"image": "image"}, store="raw", workers=0)
    rows = h5py_rows(pose, POSE_FIELDS)
    dataset = OPEN[suffix](path)
    assert_same_sample(dataset[4], rows[4])
    assert dataset[4]["image"].dtype == np.uint8
    assert OPEN[suffix](path, decode="pil")[4]["image"].size == (64, 64)
    batch = dataset.read_batch_columns([4, 2])
    assert type(batch) is ColumnBatch
    tensors = next(iter(DataLoader(OPEN[suffix](path, decode="tensor"), batch_size=5)))
    assert tensors["image"].shape == (5, 3, 64, 64)
    assert torch.equal(tensors["image"][3], torch.from_numpy(rows[3]["image"]).permute(2, 0, 1))
    # a user's file takes decode="numpy" too: the same line works on both
    assert_same_sample(HDF5Dataset(pose, decode="numpy")[4], rows[4])


def test_the_loader_reads_batches_by_column_only_without_per_sample_code(
    pose, tmp_path, monkeypatch
):
    path = tmp_path / "pose.lmdb"
    pack(pose, path, workers=0)
    calls = []
    read = LMDBDataset.read_batch_columns

    def counted(self, indices):
        batch = read(self, indices)
        calls.append(type(batch))
        return batch

    monkeypatch.setattr(LMDBDataset, "read_batch_columns", counted)
    batch = next(iter(DataLoader(LMDBDataset(path), batch_size=8)))
    assert calls == [ColumnBatch] and batch["image"].shape == (8, 64, 64, 3)
    seen = []
    dataset = LMDBDataset(path, transform=lambda sample: seen.append(sorted(sample)) or sample)
    batch = next(iter(DataLoader(dataset, batch_size=8)))
    assert calls[-1] is type(None) and len(seen) == 8 and seen[0] == sorted(POSE_FIELDS)
    assert batch["part"].shape == (8, 14, 2)


def test_a_flipped_byte_in_a_field_is_a_pack_error_naming_field_and_rows(pose, tmp_path, suffix):
    path = tmp_path / f"pose{suffix}"
    pack(pose, path, workers=0)
    block = read_metadata(path)["columns"]["rows_per_block"]
    part = h5py_rows(pose, ["part"])[block + 1]["part"].tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(part)
    assert at > 0
    while at >= 0:
        data[at + 3] ^= 0x40
        at = data.find(part, at + 1)
    path.write_bytes(bytes(data))
    dataset = OPEN[suffix](path)
    dataset[0]  # other blocks still read
    rows = f"rows {block}-{2 * block - 1}"
    with pytest.raises(PackError, match=f"damaged field 'part' {rows} .checksum mismatch"):
        dataset[block + 3]
    with pytest.raises(PackError, match=f"damaged field 'part' {rows}"):  # still, on every read
        next(iter(DataLoader(dataset, batch_size=4, sampler=[0, block + 1, 2, 3])))
    report = fastloader.verify(path)
    assert [(row, "part" in reason) for row, reason in report.bad] == [(block, True)]


def test_a_flipped_byte_in_a_string_column_is_found(pose, tmp_path, suffix):
    path = tmp_path / f"pose{suffix}"
    pack(pose, path, workers=0)
    data = bytearray(path.read_bytes())
    at = data.find("im00050_é".encode())
    assert at > 0
    while at >= 0:  # LMDB may keep an old copy of a page: flip every copy
        data[at + 2] ^= 0x01
        at = data.find("im00050_é".encode(), at + 1)
    path.write_bytes(bytes(data))
    with pytest.raises(PackError, match="damaged field 'imagename' rows"):
        OPEN[suffix](path)[50]


def test_damaged_offsets_are_refused_when_the_pack_opens(tmp_path, suffix):
    path = tmp_path / f"det{suffix}"
    pack(Detection(6), path, store="raw", workers=0)
    data = bytearray(path.read_bytes())
    # boxes are ragged: their offsets (int64) 0, 4*16*n0, ... are under the metadata checksum
    ends = np.cumsum([0] + [len(Detection(6)[i]["boxes"]) * 16 for i in range(6)])
    at = data.find(ends.astype("<i8").tobytes())
    assert at > 0
    while at >= 0:  # LMDB may keep an old copy of a page: flip every copy
        data[at + 9] ^= 0x01
        at = data.find(ends.astype("<i8").tobytes(), at + 1)
    path.write_bytes(bytes(data))
    with pytest.raises(PackError, match="damaged col1.offsets"):
        OPEN[suffix](path)


def test_ragged_fields_and_every_kind_round_trip_by_columns(tmp_path, suffix):
    source = Detection(9)
    path = tmp_path / f"det{suffix}"
    pack(source, path, store="encoded", workers=0)
    columns = read_metadata(path)["columns"]["fields"]
    # PNG, boxes and labels by offsets; names NUL-padded to the longest
    assert [column["storage"] for column in columns] == ["ragged"] * 3 + ["fixed"]
    dataset = OPEN[suffix](path)
    for index in range(9):
        got, want = dataset[index], source[index]
        assert np.array_equal(got["image"], np.asarray(want["image"]))
        assert got["boxes"].dtype == np.float32 and np.array_equal(got["boxes"], want["boxes"])
        assert got["name"] == want["name"]
    assert fastloader.verify(path).ok


def test_rows_spread_over_lmdb_segments_read_the_same(pose, tmp_path, monkeypatch):
    monkeypatch.setattr(column_layout, "SEGMENT_BYTES", 40 * 12288)  # 2 blocks per segment
    path = tmp_path / "pose.lmdb"
    pack(pose, path, workers=0)
    layout = read_metadata(path)["columns"]
    assert layout["rows_per_segment"] < 70
    dataset, in_place = LMDBDataset(path), HDF5Dataset(pose)
    order = list(range(69, -1, -3))
    got = next(iter(DataLoader(dataset, batch_size=len(order), sampler=order)))
    want = next(iter(DataLoader(in_place, batch_size=len(order), sampler=order)))
    _assert_same_batch(got, want)
    assert fastloader.verify(path).ok


def test_packs_of_the_records_layout_still_open_and_read_the_same(pose, tmp_path, suffix):
    old, new = tmp_path / f"old{suffix}", tmp_path / f"new{suffix}"
    pack(pose, old, workers=0, layout="records")
    pack(pose, new, workers=0)
    assert read_metadata(old)["version"] == 4 and "columns" not in read_metadata(old)
    assert "layout:   records" in describe(str(old))
    assert "layout:   columns" in describe(str(new)) and "fixed: 64x64x3" in describe(str(new))
    loaders = [DataLoader(OPEN[suffix](p), batch_size=10, shuffle=True, seed=1) for p in (old, new)]
    for got, want in zip(*loaders, strict=True):
        _assert_same_batch(got, want)
    with pytest.raises(ValueError, match="layout must be one of"):
        pack(pose, tmp_path / f"x{suffix}", layout="rows")


def _reseal(path, suffix, change) -> None:
    """Rewrite a pack's metadata with ``change``, its checksum made right again (as a crafted
    file would)."""
    import json

    import lmdb

    from fastloader.formats.metadata import _canonical, array_checksum

    def changed(raw: bytes) -> bytes:
        metadata = change(json.loads(raw))
        metadata["checksum"] = array_checksum(_canonical(metadata))
        return json.dumps(metadata).encode()

    if suffix == ".lmdb":
        env = lmdb.open(str(path), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            txn.put(b"__metadata__", changed(txn.get(b"__metadata__")))
        env.close()
    else:
        with h5py.File(path, "r+") as file:
            raw = changed(file["metadata"][()].tobytes())
            del file["metadata"]
            file["metadata"] = np.frombuffer(raw, dtype=np.uint8)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: {**m, "count": 1 << 40}, "corrupt"),  # nothing allocated for 2**40 rows
        (lambda m: {**m, "columns": {**m["columns"], "rows_per_segment": 8}}, "corrupt"),
        (lambda m: {**m, "columns": {**m["columns"], "rows_per_block": 3}}, "rows per block"),
        (lambda m: {k: v for k, v in m.items() if k != "columns"}, "no columns"),
    ],
)
def test_crafted_column_metadata_is_refused(tmp_path, suffix, change, match):
    path = tmp_path / f"det{suffix}"
    pack(Detection(6), path, store="raw", workers=0)
    _reseal(path, suffix, change)
    with pytest.raises(PackError, match=match):
        OPEN[suffix](path)


class Scalars:
    """Fixed fields of every kind: numbers, bools, padded strings and bytes, a 0-d array."""

    def __len__(self):
        return 40

    def __getitem__(self, index):
        return {
            "i": index * 7 - 100,
            "f": index / 3,
            "b": index % 3 == 0,
            "s": f"n{index % 4}é",
            "ascii": f"plain{index}",  # decoded by NumPy in one call
            "raw": bytes([index + 1, 0, index + 1]),  # ends in a byte that is not NUL
            "zero_d": np.array(index / 5, np.float32),
        }


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_by_column_equal_batches_of_samples_for_every_fixed_kind(tmp_path, workers):
    path = tmp_path / "scalars.h5"
    pack(Scalars(), path, workers=0)
    columns = read_metadata(path)["columns"]["fields"]
    assert [column["storage"] for column in columns] == ["fixed"] * 7
    by_columns = HDF5Dataset(path)
    by_samples = HDF5Dataset(path, transform=lambda sample: sample)  # per-sample reads
    loaders = [
        DataLoader(dataset, batch_size=16, shuffle=True, seed=2, num_workers=workers)
        for dataset in (by_columns, by_samples)
    ]
    for got, want in zip(*loaders, strict=True):
        _assert_same_batch(got, want)
    assert by_columns[5] == {**Scalars()[5], "zero_d": by_columns[5]["zero_d"]}
    assert by_columns[5]["zero_d"].shape == () and by_columns[5]["zero_d"] == np.float32(1.0)


@pytest.mark.parametrize("cached", [True, False])
def test_text_columns_read_the_same_batches_cached_or_not(tmp_path, monkeypatch, cached):
    # NOTE [ Text columns decoded once ]: a process keeps decoded names only within a budget
    if not cached:
        monkeypatch.setattr(column_reader, "TEXT_CACHE_BYTES", 0)
    path = tmp_path / "scalars.lmdb"
    pack(Scalars(), path, workers=0)
    dataset = LMDBDataset(path)
    table = dataset.column_table()
    texts = [column for column in table.columns if column.texts]
    assert [column.name for column in texts] == ["s", "ascii", "raw"]
    assert all((column.cache is not None) == cached for column in texts)
    for epoch in range(2):  # the second epoch reads what the first one decoded
        for got in DataLoader(dataset, batch_size=16, shuffle=True, seed=epoch):
            for row, name in enumerate(got["ascii"]):
                want = Scalars()[int(name.removeprefix("plain"))]
                assert (got["s"][row], got["raw"][row]) == (want["s"], want["raw"])


def test_a_name_that_is_not_utf8_raises_on_every_batch_read(tmp_path, suffix):
    # checksums off (the user's choice), a damaged name still never reads as another value
    path = tmp_path / f"scalars{suffix}"
    pack(Scalars(), path, workers=0)
    data = bytearray(path.read_bytes())
    at = data.find("n1é".encode())  # rows 1, 5, 9, ...: every copy
    while at >= 0:
        data[at] = 0xFF
        at = data.find("n1é".encode(), at + 1)
    path.write_bytes(bytes(data))
    dataset = OPEN[suffix](path, verify_checksums=False)
    assert next(iter(DataLoader(dataset, batch_size=1, sampler=[2])))["s"] == ["n2é"]
    for _ in range(2):  # not kept as a value: the same error on every read
        with pytest.raises(PackError, match=r"row 1: corrupt field 's' \(not UTF-8\)"):
            next(iter(DataLoader(dataset, batch_size=4, sampler=[0, 1, 2, 3])))


@pytest.mark.parametrize(
    ("flag", "version", "said"), [("columns", 5, "columns"), ("records", 4, "records")]
)
def test_the_pack_command_writes_the_layout_asked_and_info_says_it(
    pose, tmp_path, capsys, flag, version, said
):
    from fastloader.cli import main

    path = tmp_path / "pose.lmdb"
    assert main([str(pose), str(path), "--layout", flag, "--quiet", "--workers", "0"]) == 0
    assert read_metadata(path)["version"] == version
    assert main(["--info", str(path)]) == 0
    assert f"layout:   {said} " in capsys.readouterr().out
    _assert_same_batch(
        next(iter(DataLoader(LMDBDataset(path), batch_size=8))),
        next(iter(DataLoader(HDF5Dataset(pose), batch_size=8))),
    )


def test_the_pack_command_refuses_an_unknown_layout_in_the_librarys_words(pose, tmp_path, capsys):
    from fastloader.cli import main

    assert main([str(pose), str(tmp_path / "pose.lmdb"), "--layout", "rows"]) == 2
    err = capsys.readouterr().err
    assert f"--layout must be one of {', '.join(column_layout.LAYOUTS)}, got 'rows'" in err
    assert not (tmp_path / "pose.lmdb").exists()
