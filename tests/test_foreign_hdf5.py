"""Users' own HDF5 files and LMDB environments, read in place by HDF5Dataset / LMDBDataset."""

from __future__ import annotations

import json
import multiprocessing
import pickle

import h5py
import lmdb
import numpy as np
import pytest
import torch

from fastloader import DataLoader, HDF5Dataset, LMDBDataset, PackError, open_pack, pack
from fastloader.datasets.users_files import HDF5FileDataset, LMDBFileDataset
from fastloader.formats.hdf5_foreign import HDF5File
from tests._fields import POSE_COUNT, POSE_FIELDS, assert_same_sample, h5py_rows, make_pose_file
from tests._images import ImageDataset

ALL = (*POSE_FIELDS, "labels/visible")


@pytest.fixture
def pose(tmp_path):
    return make_pose_file(tmp_path / "pose.h5")


def test_a_users_hdf5_file_reads_as_dicts_equal_to_h5py(pose):
    dataset = HDF5Dataset(pose, fields=list(ALL))
    assert isinstance(dataset, HDF5FileDataset) and len(dataset) == POSE_COUNT
    want = h5py_rows(pose, ALL)
    for index in range(POSE_COUNT):
        assert_same_sample(dataset[index], want[index])
    order = [5, 0, 23, 5, 11, -1]
    for index, sample in zip(order, dataset.__getitems__(order), strict=True):
        assert_same_sample(sample, want[index])
    assert isinstance(dataset[0]["imagename"], str)


def test_default_fields_are_the_top_level_datasets(pose):
    dataset = HDF5Dataset(pose)
    assert sorted(dataset.field_names) == sorted(POSE_FIELDS)  # the group is not walked


def test_contiguous_fields_are_mapped_and_chunked_ones_read_by_h5py(pose):
    dataset = HDF5File(pose, fields=list(ALL))
    mapped = {field.name: field.offset is not None for field in dataset.fields}
    assert mapped == {
        "image": True,
        "part": True,
        "S": True,
        "imagename": False,
        "labels/visible": False,
    }


def test_fields_as_a_tuple_in_the_order_given(pose):
    dataset = HDF5Dataset(pose, fields=["part", "labels/visible"], as_tuple=True)
    part, visible = dataset[3]
    with h5py.File(pose) as file:
        assert np.array_equal(part, file["part"][3])
        assert np.array_equal(visible, file["labels/visible"][3])
    with pytest.raises(ValueError, match="as_tuple=True needs fields"):
        HDF5Dataset(pose, as_tuple=True)


@pytest.mark.parametrize(
    "workers, method", [(0, None), (2, "fork"), pytest.param(2, "spawn", marks=pytest.mark.slow)]
)
def test_loader_workers_read_every_field_equal_to_h5py(pose, workers, method):
    dataset = HDF5Dataset(pose, fields=list(ALL))
    dataset[0]  # the parent opens the file first: workers must not use its handle
    context = multiprocessing.get_context(method) if method else None
    loader = DataLoader(
        dataset,
        batch_size=5,
        num_workers=workers,
        shuffle=True,
        seed=1,
        multiprocessing_context=context,
    )
    seen = {}
    for batch in loader:
        for at, name in enumerate(batch["imagename"]):
            seen[name] = {key: batch[key][at] for key in ALL}
    want = h5py_rows(pose, ALL)
    assert len(seen) == POSE_COUNT
    for row in want:
        got = seen[row["imagename"]]
        for key in ("image", "part", "S", "labels/visible"):
            assert torch.equal(got[key], torch.from_numpy(np.asarray(row[key]))), key


def test_pickled_dataset_holds_no_open_file(pose):
    dataset = HDF5Dataset(pose)
    dataset[0]
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._handle is None and len(pickle.dumps(dataset)) < 4096
    assert_same_sample(copy[2], dataset[2])


def test_misaligned_datasets_are_refused_naming_them(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as file:
        file["x"] = np.zeros((5, 2))
        file["y"] = np.zeros(4)
    with pytest.raises(PackError, match="not aligned.*x has 5, y has 4"):
        HDF5Dataset(path)
    assert len(HDF5Dataset(path, fields=["y"])) == 4


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda f: f.create_dataset("scalar", data=3.0), "'scalar' is 0-d"),
        (
            lambda f: f.create_dataset("ragged", (4,), dtype=h5py.vlen_dtype(np.int32)),
            "'ragged' holds .*variable-length",
        ),
        (lambda f: f.create_dataset("refs", (4,), dtype=h5py.ref_dtype), "'refs' holds"),
    ],
)
def test_unreadable_datasets_are_named_at_construction(tmp_path, make, match):
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as file:
        file["ok"] = np.zeros(4)
        make(file)
    with pytest.raises(PackError, match=match):
        HDF5Dataset(path)
    with pytest.raises(PackError, match="'nope': no such dataset"):
        HDF5Dataset(path, fields=["ok", "nope"])


def test_storage_in_other_files_is_refused_unless_allowed(tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(8, dtype="<f8").tobytes())
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as file:
        file["x"] = np.arange(8.0)
    cases = {}
    for name in ("external", "link", "virtual"):
        path = cases[name] = tmp_path / f"{name}.h5"
        with h5py.File(path, "w") as file:
            if name == "external":
                file.create_dataset("x", (8,), "<f8", external=[(str(raw), 0, 64)])
            elif name == "link":
                file["x"] = h5py.ExternalLink(str(other), "x")
            else:
                layout = h5py.VirtualLayout((8,), "<f8")
                layout[:] = h5py.VirtualSource(str(other), "x", shape=(8,))
                file.create_virtual_dataset("x", layout)
    for name, path in cases.items():
        with pytest.raises(PackError, match="other file|external link"):
            HDF5Dataset(path)
        allowed = HDF5Dataset(path, allow_external=True)
        assert [allowed[i]["x"] for i in range(8)] == list(range(8)), name


def test_rows_larger_than_the_file_could_hold_are_refused(tmp_path):
    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as file:  # chunked, never written: a tiny file declaring 8 TB rows
        file.create_dataset("x", (4, 1 << 40), "<f8", chunks=(1, 1 << 16))
    with pytest.raises(PackError, match="'x' declares rows of 8796093022208 bytes"):
        HDF5Dataset(path)


def test_a_truncated_file_is_a_clear_error(pose):
    data = pose.read_bytes()
    pose.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(PackError, match="pose.h5: (not a readable HDF5 file|truncated)"):
        HDF5Dataset(pose)


def test_big_endian_rows_come_back_native(tmp_path):
    path = tmp_path / "be.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("x", data=np.arange(12, dtype=">f4").reshape(4, 3))
    row = HDF5Dataset(path)[2]["x"]
    assert row.dtype == np.float32 and row.dtype.isnative and row.tolist() == [6, 7, 8]
    assert torch.from_numpy(row).sum() == 21


def test_packs_still_open_as_packs(tmp_path):
    path = tmp_path / "p.h5"
    pack(ImageDataset(), path, workers=0)
    assert type(HDF5Dataset(path)) is HDF5Dataset
    foreign = make_pose_file(tmp_path / "pose.h5")
    with pytest.raises(PackError, match="not a complete fastloader pack"):
        open_pack(foreign)


# --- LMDB environments -------------------------------------------------------------------------


@pytest.fixture
def env_dir(tmp_path):
    path = tmp_path / "env"
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        txn.put(b"b", json.dumps({"x": 2}).encode())
        txn.put(b"a", json.dumps({"x": 1}).encode())
        txn.put(b"c", pickle.dumps({"x": 3}))  # never unpickled: read as bytes
    env.close()
    return path


def test_an_lmdb_environment_reads_values_in_key_order(env_dir):
    dataset = LMDBDataset(env_dir)
    assert isinstance(dataset, LMDBFileDataset) and len(dataset) == 3
    assert [dataset.key(i) for i in range(3)] == [b"a", b"b", b"c"]
    assert dataset[0] == b'{"x": 1}' and dataset[2] == pickle.dumps({"x": 3})
    decoded = LMDBDataset(env_dir, keys=["b", "a"], decode=json.loads)
    assert [decoded[0], decoded[1]] == [{"x": 2}, {"x": 1}]
    with pytest.raises(KeyError, match="zz"):
        LMDBDataset(env_dir, keys=[b"zz"])
    loader = DataLoader(decoded, batch_size=2, num_workers=2)
    assert [batch["x"].tolist() for batch in loader] == [[2, 1]]


def test_a_single_file_lmdb_environment_is_read_too(tmp_path):
    path = tmp_path / "one.mdb"
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        for key in (b"k1", b"k2", b"k3"):
            txn.put(key, key * 3)
    env.close()
    dataset = LMDBDataset(path)
    assert isinstance(dataset, LMDBFileDataset)
    assert dataset.__getitems__([2, 0]) == [b"k3k3k3", b"k1k1k1"]
    again = LMDBDataset(path)  # a second reader in the same process, its own map
    assert again[1] == b"k2k2k2" and dataset[1] == b"k2k2k2"


def test_fixed_length_strings_are_mapped_and_read_as_str(tmp_path):
    path = tmp_path / "s.h5"
    names = [f"n{index}".encode() for index in range(6)]
    with h5py.File(path, "w") as file:
        file.create_dataset("name", data=np.array(names, dtype="S8"))
    dataset = HDF5Dataset(path)
    assert dataset.fields[0].offset is not None
    assert [dataset[index]["name"] for index in range(6)] == [f"n{i}" for i in range(6)]


def test_a_truncated_lmdb_environment_is_a_clear_error(env_dir):
    data = env_dir / "data.mdb"
    data.write_bytes(data.read_bytes()[:5000])
    with pytest.raises(PackError, match="truncated or damaged LMDB file"):
        LMDBDataset(env_dir)


def test_random_transforms_are_seeded_per_sample_for_any_worker_count(pose):
    def jitter(sample):
        return {"part": sample["part"] + np.random.rand(), "name": sample["imagename"]}

    dataset = HDF5Dataset(pose, transform=jitter)
    seen = []
    for workers in (0, 2):
        loader = DataLoader(dataset, batch_size=4, num_workers=workers, shuffle=True, seed=5)
        seen.append(
            {
                name: part
                for batch in loader
                for name, part in zip(batch["name"], batch["part"], strict=True)
            }
        )
    assert seen[0].keys() == seen[1].keys() and len(seen[0]) == POSE_COUNT
    assert all(torch.equal(seen[0][name], seen[1][name]) for name in seen[0])


def test_pack_arguments_on_a_users_file_say_what_it_is(pose):
    with pytest.raises(TypeError, match="not a fastloader pack but a user's own file.*decode="):
        HDF5Dataset(pose, decode="pil")
    with pytest.raises(TypeError, match="user's own file.*verify_checksums="):
        HDF5Dataset(pose, verify_checksums=False)
    # decode="numpy" is what a user's file gives, and what its pack gives by default
    assert isinstance(HDF5Dataset(pose, decode="numpy")[0]["image"], np.ndarray)


@pytest.mark.parametrize("bad", [POSE_COUNT, -POSE_COUNT - 1])
def test_a_batch_with_an_index_out_of_range_is_refused_naming_it(pose, bad):
    dataset = HDF5Dataset(pose)
    with pytest.raises(IndexError, match=f"index {bad} out of range"):
        dataset.__getitems__([0, -1, bad])
    assert [sample["imagename"] for sample in dataset.__getitems__([-POSE_COUNT, -1])] == [
        dataset[0]["imagename"],
        dataset[POSE_COUNT - 1]["imagename"],
    ]
