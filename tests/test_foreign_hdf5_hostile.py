"""Users' own HDF5 files as a hostile user makes them: links that lead to other files, stored
types h5py converts, damaged data addresses, files truncated or rewritten while a loader reads.

Every case ends in what h5py returns or a PackError naming the file and the dataset (NOTE
[ Foreign HDF5 files ] in formats/hdf5_foreign.py); what could crash runs in a subprocess.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from fastloader import HDF5Dataset, PackError
from fastloader.formats.hdf5_foreign import HDF5File
from tests._fields import make_pose_file

ROOT = Path(__file__).resolve().parents[1]


def h5py_column(path: Path, name: str) -> list:
    with h5py.File(path, "r") as file:
        return file[name][()].tolist()


def test_a_soft_link_through_an_external_link_reads_the_other_file_or_is_refused(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as file:
        file["pad"] = np.zeros(1000, "<i4")  # puts x at an offset where main.h5 has data
        file["x"] = np.full(4, 7, "<i4")
    main = tmp_path / "main.h5"
    with h5py.File(main, "w") as file:
        file["pad"] = np.arange(5000, dtype="<i4")
        file["ext"] = h5py.ExternalLink(str(other), "/")
        file["x"] = h5py.SoftLink("/ext/x")
    assert h5py_column(main, "x") == [7, 7, 7, 7]
    with pytest.raises(PackError, match="main.h5: dataset 'x' lies in another file"):
        HDF5Dataset(main, fields=["x"])
    with pytest.raises(PackError, match="'x' lies in another file|external link"):
        HDF5Dataset(main)
    allowed = HDF5File(main, fields=["x"], allow_external=True)
    assert allowed.fields[0].offset is None  # read by h5py, in the other file
    assert [allowed[i]["x"] for i in range(4)] == [7, 7, 7, 7]


def _retype(path: Path, find: bytes, replace: bytes) -> None:
    data = path.read_bytes()
    assert data.count(find) == 1
    path.write_bytes(data.replace(find, replace))


def test_an_n_bit_integer_dataset_reads_as_h5py_reads_it(tmp_path):
    path = tmp_path / "nbit.h5"
    with h5py.File(path, "w") as file:
        file["x"] = np.array([3 << 8, 2 << 8, 5, 7], dtype="<u4")
    # the stored type: 24 bits of precision at bit offset 8 (an N-bit integer)
    _retype(
        path, bytes.fromhex("100000000400000000002000"), bytes.fromhex("100000000400000008001800")
    )
    want = h5py_column(path, "x")
    assert want == [3, 2, 0, 0]
    dataset = HDF5File(path)
    assert dataset.fields[0].offset is None
    assert [dataset[i]["x"] for i in range(4)] == want


@pytest.mark.parametrize("pad", [h5py.h5t.STR_SPACEPAD, h5py.h5t.STR_NULLTERM])
def test_padded_fixed_strings_read_as_h5py_reads_them(tmp_path, pad):
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as file:
        kind = h5py.h5t.C_S1.copy()
        kind.set_size(8)
        kind.set_strpad(pad)
        space = h5py.h5s.create_simple((3,))
        created = h5py.h5d.create(file.id, b"name", kind, space)
        created.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array([b"cde", b"a", b"abcdefgh"], "S8"))
    want = [value.decode() for value in h5py_column(path, "name")]
    dataset = HDF5Dataset(path)
    assert dataset.fields[0].offset is None
    assert [dataset[i]["name"] for i in range(3)] == want
    assert want[0] == "cde"


def test_big_endian_and_compound_datasets_map_only_what_h5py_returns(tmp_path):
    path = tmp_path / "t.h5"
    compound = np.zeros(4, dtype=[("a", "<i2"), ("b", ">f8")])
    compound["a"], compound["b"] = [1, 2, 3, 4], [0.5, 1.5, 2.5, 3.5]
    with h5py.File(path, "w") as file:
        file["be"] = np.arange(4, dtype=">i8") * 1000
        file["c"] = compound
    dataset = HDF5File(path)
    assert all(field.offset is not None for field in dataset.fields)
    assert [dataset[i]["be"] for i in range(4)] == h5py_column(path, "be")
    assert [dataset[i]["c"].tolist() for i in range(4)] == h5py_column(path, "c")


@pytest.mark.parametrize(
    "address",
    [1 << 40, "into a", 0],
    ids=["past the end", "into another dataset", "zero"],
)
def test_a_damaged_data_address_is_an_error_naming_the_dataset(tmp_path, address):
    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as file:
        file["a"] = np.arange(100, dtype="<i4")
        file["b"] = np.arange(100, dtype="<f8")
    with h5py.File(path, "r") as file:
        offset, inside = file["b"].id.get_offset(), file["a"].id.get_offset() + 200
    new = inside if address == "into a" else address
    code = (
        "import sys\n"
        "from fastloader import PackError\n"
        "from fastloader.formats.hdf5_foreign import HDF5File\n"
        "try:\n"
        "    f = HDF5File(sys.argv[1])\n"
        "    print('read', f.field_names, f[3])\n"
        "except PackError as error:\n"
        "    print('PackError', error)\n"
    )
    _retype(path, struct.pack("<QQ", offset, 800), struct.pack("<QQ", new, 800))
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PackError" in done.stdout and "'b'" in done.stdout, done.stdout


def test_a_dangling_link_is_named_not_left_out(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as file:
        file["a"] = np.arange(4)
        file["gone"] = h5py.SoftLink("/nowhere")
    with pytest.raises(PackError, match="dataset 'gone' cannot be opened"):
        HDF5Dataset(path)
    assert len(HDF5Dataset(path, fields=["a"])) == 4


def test_rows_of_several_strings_are_lists_of_str(tmp_path):
    path = tmp_path / "pairs.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset(
            "vlen",
            data=np.array([["a", "b"], ["c", "dé"]], dtype=object),
            dtype=h5py.string_dtype(),
        )
        file["fixed"] = np.array([[b"a", b"b"], [b"c", b"d"]], dtype="S3")
    dataset = HDF5Dataset(path)
    assert dataset[0] == {"fixed": ["a", "b"], "vlen": ["a", "b"]}
    assert dataset.__getitems__([1, 0])[0] == {"fixed": ["c", "d"], "vlen": ["c", "dé"]}


_WHILE_READ = """
import sys, time
import h5py, numpy as np
from fastloader import DataLoader, HDF5Dataset, PackError
path, workers, change = sys.argv[1], int(sys.argv[2]), sys.argv[3]
loader = DataLoader(HDF5Dataset(path, fields=["image", "part"]), batch_size=4,
                    num_workers=workers, persistent_workers=False)
try:
    for i, batch in enumerate(loader):
        if i == 1:
            time.sleep(1.0)  # the workers' reads of the batches asked for so far are done
            if change == "truncate":
                open(path, "r+b").truncate(4096)
            else:  # another HDF5 file's bytes written over this one, in place
                with h5py.File(path + ".new", "w") as file:
                    file["other"] = np.zeros(3)
                with open(path + ".new", "rb") as new, open(path, "r+b") as old:
                    old.write(new.read())
                    old.truncate()
    print("no error")
except PackError as error:
    print("PackError", error)
"""


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_changed_while_a_loader_reads_it_is_a_clear_error(tmp_path, workers, change):
    path = make_pose_file(tmp_path / "pose.h5", count=96, chunked=False)  # 24 batches
    done = subprocess.run(
        [sys.executable, "-c", _WHILE_READ, str(path), str(workers), change],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "PackError" in done.stdout and "changed since this dataset opened it" in done.stdout


_READ_ALL = """
import sys
from fastloader import PackError
from fastloader.formats.hdf5_foreign import HDF5File
try:
    dataset = HDF5File(sys.argv[1])
    print("read", dataset.read_many(range(len(dataset))))
except PackError as error:
    print("PackError", error)
"""


def test_a_damaged_global_heap_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "text.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("text", data=[f"t{i}é" for i in range(10)], dtype=h5py.string_dtype())
    data = bytearray(path.read_bytes())
    at = data.index("t9é".encode()) - 8  # the heap object's size, before its bytes
    struct.pack_into("<Q", data, at, 0x0E2D16)  # what made h5py spin for minutes (issue 27)
    path.write_bytes(bytes(data))
    done = subprocess.run(
        [sys.executable, "-c", _READ_ALL, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PackError" in done.stdout and "'text' is damaged" in done.stdout, done.stdout


def test_variable_length_strings_with_many_heap_collections_read_as_h5py(tmp_path):
    path = tmp_path / "v.h5"
    texts = ["" if i % 7 == 0 else "é" * (i * 13 % 2900) + str(i) for i in range(300)]
    with h5py.File(path, "w") as file:
        file.create_dataset("t", data=texts, dtype=h5py.string_dtype())
        file.create_dataset("never", shape=(300,), dtype=h5py.string_dtype())
    dataset = HDF5File(path)
    assert dataset.fields[1].heap_ids is not None
    got = dataset.read_many(list(range(299, -1, -1)))
    assert [sample["t"] for sample in got] == texts[::-1]
    assert {sample["never"] for sample in got} == {""}
