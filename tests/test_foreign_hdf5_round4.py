"""Users' HDF5 files whose chunk index or strings lie (issue 39, items 5 and 6): a chunk stored
shorter than its layout, a filter mask or pipeline that leaves a chunk short, a chunk outside the
file, strings that are not of their declared character set.

h5py reads such chunks from uninitialised memory (values that differ between runs) and gives
such strings as bytes its ``asstr()`` refuses; fastloader raises a PackError naming the file,
the dataset and the chunk's rows or the sample, before any byte is used (NOTE [ Chunks checked
before h5py reads them ] in formats/hdf5_chunks.py, NOTE [ Strings decoded as h5py decodes
them ] in formats/hdf5_text.py), in the main process and in workers alike.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from fastloader import DataLoader, HDF5Dataset, PackError
from fastloader.formats.hdf5_foreign import HDF5File
from tests._hdf5_craft import chunk_info, patch_chunk

ROWS = np.arange(40 * 9, dtype="<i4").reshape(40, 9)


def _chunked(path: Path, **options) -> Path:
    with h5py.File(path, "w") as file:
        file.create_dataset("x", data=ROWS, chunks=(4, 9), **options)
        file["y"] = np.arange(40, dtype="<i8")  # a mapped field beside it
    return path


def _read(path: Path, rows: list[int], workers: int = 0) -> list:
    dataset = HDF5Dataset(path)
    if not workers:
        return [dataset[i]["x"] for i in rows]
    loader = DataLoader(dataset, batch_size=2, num_workers=workers, sampler=rows)
    return [row for batch in loader for row in batch["x"].numpy()]


def test_an_unfiltered_chunk_stored_short_is_refused_naming_its_rows(tmp_path):
    path = _chunked(tmp_path / "short.h5")
    patch_chunk(path, "x", 1, size=25)  # rows 4-7: 25 of the chunk's 144 bytes
    with h5py.File(path, "r") as file:  # h5py reads it, from memory it never wrote
        assert file["x"][4:8].shape == (4, 9)
    with pytest.raises(PackError) as raised:
        HDF5Dataset(path)  # the whole index is checked when the dataset is created
    message = str(raised.value)
    assert "short.h5: dataset 'x' is damaged" in message and "rows 4-7" in message, message
    assert "25 bytes" in message and "needs 144" in message, message


@pytest.mark.parametrize("size", [0, 143, 145, 1 << 30])
def test_any_stored_size_but_the_chunks_is_refused_when_unfiltered(tmp_path, size):
    path = _chunked(tmp_path / "sizes.h5")
    patch_chunk(path, "x", 9, size=size)
    with pytest.raises(PackError, match="sizes.h5: dataset 'x' .*rows 36-39"):
        HDF5File(path)


def test_a_chunk_outside_the_file_is_refused(tmp_path):
    path = _chunked(tmp_path / "far.h5")
    patch_chunk(path, "x", 2, address=path.stat().st_size - 100)  # runs 44 bytes past the end
    with pytest.raises(PackError, match=r"far.h5: dataset 'x' .*rows 8-11.* outside the file"):
        HDF5File(path)


def test_a_shuffled_chunk_cut_short_is_refused(tmp_path):
    path = _chunked(tmp_path / "shuffle.h5", shuffle=True)
    patch_chunk(path, "x", 0, size=100)
    with pytest.raises(PackError, match="shuffle.h5: dataset 'x' .*rows 0-3.*unfilters to 100"):
        HDF5File(path)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_deflate_stream_that_inflates_short_is_refused(tmp_path, workers):
    path = _chunked(tmp_path / "gzip.h5", compression="gzip")
    short = zlib.compress(ROWS[4:6].tobytes())  # a valid stream of half the chunk's bytes
    info = chunk_info(path, "x", 1)
    assert len(short) <= info.size
    patch_chunk(path, "x", 1, size=len(short), payload=short)
    with h5py.File(path, "r") as file:  # h5py reads it, half from memory it never wrote
        assert np.array_equal(file["x"][4:6], ROWS[4:6])
    # a filtered chunk is checked when a process first reads it: the others still read
    got = _read(path, [0, 3, 8, 39], workers)
    assert np.array_equal(np.stack(got), ROWS[[0, 3, 8, 39]])
    with pytest.raises(PackError, match=r"gzip.h5: dataset 'x' .*rows 4-7.*unfilters to 72"):
        _read(path, [6], workers)


def test_a_filter_mask_that_skips_deflate_on_a_compressed_chunk_is_refused(tmp_path):
    path = _chunked(tmp_path / "mask.h5", compression="gzip")
    patch_chunk(path, "x", 0, mask=1)  # "deflate not applied": the compressed bytes as raw
    with pytest.raises(PackError, match="mask.h5: dataset 'x' .*rows 0-3.*stored unfiltered"):
        HDF5File(path)


def test_valid_chunked_layouts_read_as_h5py_reads_them(tmp_path):
    # no false alarm: pipelines, chunks split along rows and columns, partial edge chunks,
    # chunks never written (the fill value), strings in chunks
    path = tmp_path / "valid.h5"
    rng = np.random.default_rng(4)
    with h5py.File(path, "w") as file:
        file.create_dataset("g", data=ROWS, chunks=(3, 4), compression="gzip", shuffle=True,
                            fletcher32=True)  # fmt: skip
        file.create_dataset("f", data=rng.random((40, 5, 7)), chunks=(7, 2, 3))
        sparse = file.create_dataset("s", shape=(40, 3), dtype="<u2", chunks=(8, 3), fillvalue=9)
        sparse[10:12] = 4
        file.create_dataset("t", data=[f"t{i}é" * (i % 5) for i in range(40)],
                            dtype=h5py.string_dtype(), chunks=(6,), compression="gzip")  # fmt: skip
        file.create_dataset("b", data=rng.random(40) > 0.5, chunks=(40,), compression="lzf")
    dataset = HDF5File(path)
    assert {field.name for field in dataset.fields if field.chunks} == {"g", "t", "b"}
    order = list(rng.permutation(40))
    got = dataset.read_many(order)
    with h5py.File(path, "r") as file:
        for name in ("g", "f", "s", "b"):
            want = file[name][()][order]
            assert np.array_equal(np.array([sample[name] for sample in got]), want), name
        assert [sample["t"] for sample in got] == file["t"].asstr()[()][order].tolist()


def _strings(path: Path, kind: str, texts: list[bytes]) -> Path:
    with h5py.File(path, "w") as file:
        if kind == "fixed ascii":  # a NumPy S array: h5py stores it as ASCII
            file["s"] = np.array(texts, "S8")
        elif kind == "fixed utf-8":
            file.create_dataset("s", shape=(len(texts),), dtype=h5py.string_dtype("utf-8", 8))
            for at, text in enumerate(texts):
                file["s"][at] = text
        else:
            encoding, _, chunked = kind.partition(" ")
            file.create_dataset(
                "s", data=texts, dtype=h5py.string_dtype(encoding),
                chunks=(2,) if chunked else None,
            )  # fmt: skip
    return path


KINDS = ["utf-8", "utf-8 chunked", "ascii", "fixed ascii", "fixed utf-8"]


@pytest.mark.parametrize("kind", KINDS)
def test_strings_that_are_not_their_declared_codec_name_the_sample(tmp_path, kind):
    texts = [b"ok", b"t\xeb2", b"fine"]  # 0xeb: neither ASCII nor the start of UTF-8 here
    path = _strings(tmp_path / "bad.h5", kind, texts)
    with h5py.File(path, "r") as file, pytest.raises(UnicodeDecodeError):
        file["s"].asstr()[1]  # h5py's verdict
    dataset = HDF5File(path)
    assert dataset[0]["s"] == "ok" and dataset[2]["s"] == "fine"
    for batch in ([1], [2, 0, 1]):
        with pytest.raises(PackError, match=r"bad.h5: dataset 's', sample 1: not utf-8 text"):
            dataset.read_many(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_string_is_an_error_in_workers_too(tmp_path, workers):
    path = _strings(tmp_path / "bad.h5", "utf-8", [b"a", b"b", b"t\xeb2\xc3\xa9", b"d"])
    loader = DataLoader(HDF5Dataset(path), batch_size=2, num_workers=workers)
    with pytest.raises(PackError, match="bad.h5: dataset 's', sample 2: not utf-8"):
        list(loader)


def test_utf8_text_in_a_numpy_bytes_array_reads_as_text(tmp_path):
    # stored as ASCII by h5py; asstr() would raise, earlier releases read the text: kept
    path = _strings(tmp_path / "names.h5", "fixed ascii", ["t2é".encode(), b"plain"])
    assert [sample["s"] for sample in HDF5File(path).read_many([0, 1])] == ["t2é", "plain"]


@pytest.mark.parametrize("kind", KINDS)
def test_strings_read_as_h5py_asstr_reads_them(tmp_path, kind):
    ascii_only = "ascii" in kind
    texts = [b"ok", b"", b"plain" if ascii_only else "t2é".encode(), b"x y"]
    path = _strings(tmp_path / "good.h5", kind, texts)
    with h5py.File(path, "r") as file:
        want = file["s"].asstr()[()].tolist()
    assert [sample["s"] for sample in HDF5File(path).read_many(range(4))] == want


def test_variable_length_strings_whose_heap_ids_storage_lies_are_refused(tmp_path):
    # a storage size other than the strings' heap IDs once left them unchecked, read by h5py
    # from heap objects fastloader had not checked (NOTE [ Global heap checked before h5py ])
    path = tmp_path / "ids.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("t", data=[f"t{i}" for i in range(10)], dtype=h5py.string_dtype())
        where = struct.pack("<QQ", file["t"].id.get_offset(), file["t"].id.get_storage_size())
    data = bytearray(path.read_bytes())
    assert data.count(where) == 1  # the layout message: address, size
    struct.pack_into("<Q", data, data.index(where) + 8, 96)
    path.write_bytes(bytes(data))
    with h5py.File(path, "r") as file:
        assert file["t"].id.get_storage_size() == 96  # h5py reads it all the same
    with pytest.raises(PackError, match=r"ids.h5: dataset 't': .*96 bytes of heap IDs"):
        HDF5File(path)


@pytest.mark.parametrize("size", [25, 60])
def test_compact_storage_whose_size_lies_is_refused(tmp_path, size):
    # the rows held in the object header itself: HDF5 checks their size against the shape
    path = tmp_path / "compact.h5"
    values = np.arange(10, dtype="<i4") + 1000
    with h5py.File(path, "w") as file:
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple((10,))
        made = h5py.h5d.create(file.id, b"c", h5py.h5t.STD_I32LE, space, dcpl=plist)
        made.write(h5py.h5s.ALL, h5py.h5s.ALL, values)
    assert [sample["c"] for sample in HDF5File(path).read_many(range(10))] == values.tolist()
    data = bytearray(path.read_bytes())
    at = data.index(values.tobytes()) - 2  # the layout message's u16 size, before the rows
    assert struct.unpack_from("<H", data, at)[0] == 40
    struct.pack_into("<H", data, at, size)
    path.write_bytes(bytes(data))
    with pytest.raises(PackError, match="compact.h5: dataset 'c'"):
        HDF5File(path)
