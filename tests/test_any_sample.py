"""Packs of any sample: dicts and tuples of images, ragged arrays, scalars, str, bytes, JSON."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

import fastloader
from fastloader import DataLoader, HDF5Dataset, LMDBDataset, PackError, pack, read_metadata
from fastloader.cli import main as cli_main
from fastloader.datasets.collate import RaggedFieldError, pad_ragged, ragged_as_lists
from fastloader.formats.hdf5_foreign import HDF5File
from fastloader.packing.fields import SampleSchemaError
from tests._fields import (
    POSE_COUNT,
    POSE_FIELDS,
    Detection,
    assert_same_sample,
    h5py_rows,
    make_pose_file,
)
from tests._images import ImageDataset

OPEN = {".lmdb": LMDBDataset, ".h5": HDF5Dataset}


@pytest.fixture(params=[".lmdb", ".h5"])
def suffix(request):
    return request.param


def _assert_detection_equal(got: dict, want: dict) -> None:
    assert list(got) == ["image", "boxes", "labels", "name"]
    assert np.array_equal(np.asarray(got["image"]), np.asarray(want["image"]))
    assert got["boxes"].dtype == np.float32 and np.array_equal(got["boxes"], want["boxes"])
    assert got["labels"].dtype == np.int64 and np.array_equal(got["labels"], want["labels"])
    assert got["name"] == want["name"]


def test_a_detection_dataset_packs_and_reads_back_equal(tmp_path, suffix):
    source = Detection()
    summary = pack(source, tmp_path / f"det{suffix}", store="raw", workers=2)
    assert summary.count == len(source) and "12 samples" in summary.headline()
    dataset = OPEN[suffix](tmp_path / f"det{suffix}", decode="numpy")
    assert {len(source[i]["boxes"]) for i in range(len(source))} >= {0, 37}  # ragged, 0 too
    for index in range(len(source)):
        _assert_detection_equal(dataset[index], source[index])
    assert read_metadata(tmp_path / f"det{suffix}")["version"] == 5  # laid out by columns


def test_ragged_fields_through_the_loader(tmp_path):
    source = Detection()
    pack(source, tmp_path / "det.lmdb", store="raw", workers=0)
    dataset = LMDBDataset(tmp_path / "det.lmdb", decode="tensor")
    with pytest.raises(RaggedFieldError, match="field 'boxes' has shapes .*ragged_as_lists"):
        next(iter(DataLoader(dataset, batch_size=4)))
    batch = next(iter(DataLoader(dataset, batch_size=4, collate_fn=ragged_as_lists)))
    assert [len(boxes) for boxes in batch["boxes"]] == [len(source[i]["boxes"]) for i in range(4)]
    assert batch["image"].shape == (4, 3, 20, 24)
    padded = next(iter(DataLoader(dataset, batch_size=4, collate_fn=pad_ragged(-1))))
    lengths = padded["boxes_lengths"].tolist()
    assert lengths == [len(source[i]["boxes"]) for i in range(4)]
    assert padded["boxes"].shape == (4, max(lengths), 4)
    assert torch.equal(padded["boxes"][1, : lengths[1]], torch.from_numpy(source[1]["boxes"]))
    assert (padded["boxes"][0, lengths[0] :] == -1).all()


def test_a_flipped_byte_in_a_box_array_is_a_pack_error(tmp_path, suffix):
    class Marked(Detection):
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            sample["boxes"] = np.full((3, 4), 1234.5 + index, np.float32)
            return sample

    path = tmp_path / f"det{suffix}"
    pack(Marked(4), path, store="raw", workers=0, layout="records")  # (columns: test_column_packs)
    data = bytearray(path.read_bytes())
    marker = np.full(12, 1234.5 + 2, np.float32).tobytes()
    at = data.find(marker)
    assert at > 0
    while at >= 0:  # LMDB may keep an old copy of a page: flip every copy
        data[at + 5] ^= 0x10
        at = data.find(marker, at + 1)
    path.write_bytes(bytes(data))
    dataset = OPEN[suffix](path)
    dataset[1]  # the others still read
    with pytest.raises(PackError, match="record 2: damaged record .checksum mismatch"):
        dataset[2]
    report = fastloader.verify(path)
    assert [index for index, _ in report.bad] == [2]


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda s: {**s, "boxes": s["boxes"].astype(np.float64)},
            "sample 3 field 'boxes': float64 array .* says float32",
        ),
        (lambda s: {**s, "boxes": s["boxes"][None]}, "sample 3 field 'boxes': .*2 dimensions"),
        (lambda s: {**s, "name": 5}, "sample 3 field 'name': a int; the schema says str"),
        (lambda s: {k: v for k, v in s.items() if k != "labels"}, "sample 3: its fields"),
        (lambda s: {**s, "image": np.zeros((4, 4), np.float32)}, "sample 3 field 'image': not an"),
    ],
)
def test_a_sample_that_does_not_fit_the_schema_names_index_and_field(tmp_path, change, match):
    class Changing(Detection):
        def __getitem__(self, index):
            sample = super().__getitem__(index)
            return change(sample) if index == 3 else sample

    with pytest.raises(SampleSchemaError, match=match):
        pack(Changing(6), tmp_path / "x.lmdb", workers=0)
    assert not (tmp_path / "x.lmdb").exists()


def test_tuples_scalars_bytes_and_json_come_back_as_packed(tmp_path, suffix):
    class Mixed:
        def __len__(self):
            return 5

        def __getitem__(self, index):
            return (
                np.arange(index, dtype=np.int16).reshape(1, index),
                index,
                index / 3,
                index % 2 == 0,
                f"name {index} é",
                bytes([index]) * index,
                {"i": index, "tags": ["a"] * index, "none": None},
                np.full((2, 2), index % 2 == 0),
                np.array([1 + 2j * index], np.complex64),
            )

    pack(Mixed(), tmp_path / f"m{suffix}", workers=0)
    dataset = OPEN[suffix](tmp_path / f"m{suffix}")
    for index in range(5):
        got, want = dataset[index], Mixed()[index]
        assert isinstance(got, tuple) and len(got) == len(want)
        assert got[0].dtype == np.int16 and np.array_equal(got[0], want[0])
        assert got[1:7] == want[1:7]
        assert [type(value) for value in got[1:7]] == [int, float, bool, str, bytes, dict]
        assert np.array_equal(got[7], want[7]) and np.array_equal(got[8], want[8])


def test_image_fields_keep_store_modes_and_transforms(tmp_path):
    source = Detection(4)
    for store in ("encoded", "raw", "jpeg"):
        path = tmp_path / f"{store}.lmdb"
        pack(source, path, store=store, workers=0)
        dataset = LMDBDataset(path, decode="numpy")
        image = dataset[1]["image"]
        assert image.shape == (20, 24, 3)
        if store != "jpeg":
            assert np.array_equal(image, np.asarray(source[1]["image"]))
    seen = []
    dataset = LMDBDataset(
        tmp_path / "raw.lmdb",
        decode="pil",
        image_transform=lambda image: image.size,
        sample_transform=lambda sample: seen.append(sorted(sample)) or sample["image"],
    )
    assert dataset[0] == (24, 20) and seen == [["boxes", "image", "labels", "name"]]
    # transform= takes the whole sample, as for a user's file read in place
    whole = LMDBDataset(tmp_path / "raw.lmdb", transform=lambda sample: sorted(sample))
    assert whole[0] == ["boxes", "image", "labels", "name"]
    with pytest.raises(ValueError, match="target_transform is for .image, label. packs"):
        LMDBDataset(tmp_path / "raw.lmdb", target_transform=int)


def test_fused_transforms_crop_the_image_field(tmp_path):
    from fastloader import transforms

    pack(Detection(4), tmp_path / "d.h5", store="raw", workers=0)
    dataset = HDF5Dataset(
        tmp_path / "d.h5", image_transform=transforms.CenterCrop(8), decode="tensor"
    )
    sample = dataset[2]
    assert sample["image"].shape == (3, 8, 8) and sample["name"] == "img_2.jpg"


def test_a_uint8_array_declared_as_image_is_stored_as_one(tmp_path):
    class Arrays:
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return {"image": np.full((6, 5, 3), index, np.uint8), "y": index}

    pack(Arrays(), tmp_path / "a.lmdb", schema={"image": "image"}, store="jpeg", workers=0)
    fields = read_metadata(tmp_path / "a.lmdb")["schema"]["fields"]
    assert fields == [{"name": "image", "kind": "image"}, {"name": "y", "kind": "int"}]
    assert LMDBDataset(tmp_path / "a.lmdb", decode="numpy")[2]["image"].shape == (6, 5, 3)
    with pytest.raises(ValueError, match="names fields the samples do not have: \\['nope'\\]"):
        pack(Arrays(), tmp_path / "b.lmdb", schema={"nope": "image"}, workers=0)


def test_image_label_packs_keep_format_3(tmp_path):
    pack(ImageDataset(), tmp_path / "old.lmdb", workers=0)
    metadata = read_metadata(tmp_path / "old.lmdb")
    assert metadata["version"] == 3 and "schema" not in metadata
    assert LMDBDataset(tmp_path / "old.lmdb")[1][1] == 1


# --- the pose file of the issue, packed ----------------------------------------------------------


@pytest.fixture
def pose(tmp_path):
    return make_pose_file(tmp_path / "pose.h5", chunked=False)


def test_a_pose_file_packs_and_reads_back_equal_to_h5py(pose, tmp_path, suffix):
    target = tmp_path / f"pose_pack{suffix}"
    pack(HDF5File(pose), target, schema={"image": "image"}, store="raw", workers=2)
    want = h5py_rows(pose, POSE_FIELDS)
    dataset = OPEN[suffix](target, decode="numpy")
    for index in range(POSE_COUNT):
        assert_same_sample(dataset[index], want[index])


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_packed_pose_file_reads_equal_through_workers(pose, tmp_path, method):
    target = tmp_path / "pose.lmdb"
    pack(HDF5File(pose), target, schema={"image": "image"}, store="raw", workers=0)
    dataset = LMDBDataset(target, decode="numpy")
    loader = DataLoader(
        dataset,
        batch_size=5,
        num_workers=2,
        shuffle=True,
        seed=3,
        multiprocessing_context=multiprocessing.get_context(method),
    )
    want = {row["imagename"]: row for row in h5py_rows(pose, POSE_FIELDS)}
    seen = 0
    for batch in loader:
        for at, name in enumerate(batch["imagename"]):
            for key in ("image", "part", "S"):
                assert np.array_equal(batch[key][at].numpy(), want[name][key]), key
            seen += 1
    assert seen == POSE_COUNT


def test_the_cli_converts_a_pose_file(pose, tmp_path, capsys):
    target = tmp_path / "pose.lmdb"
    code = cli_main([str(pose), str(target), "--image-field", "image", "--store", "jpeg", "-q"])
    assert code == 0
    assert cli_main(["--info", str(target)]) == 0
    assert "image: image" in capsys.readouterr().out
    want = h5py_rows(pose, POSE_FIELDS)
    dataset = LMDBDataset(target, decode="numpy")
    for index in range(POSE_COUNT):
        got = dataset[index]
        assert got["image"].shape == want[index]["image"].shape  # JPEG: lossy
        assert_same_sample(
            {k: got[k] for k in ("part", "S", "imagename")},
            {k: want[index][k] for k in ("part", "S", "imagename")},
        )
    raw = tmp_path / "pose.h5pack.h5"
    assert (
        cli_main(
            [
                str(pose),
                str(raw),
                "--image-field",
                "image",
                "--store",
                "raw",
                "-q",
                "--fields",
                "part,imagename",
            ]
        )
        == 0
    )
    assert list(HDF5Dataset(raw)[0]) == ["part", "imagename", "image"]
    assert cli_main([str(pose), str(tmp_path / "x.lmdb"), "--image-field", "nope", "-q"]) == 1


def test_damaged_field_tables_are_pack_errors_not_crashes():
    from fastloader.formats.fields import decode_fields, encode_array, encode_fields

    schema = {
        "structure": "dict",
        "fields": [{"name": "a", "kind": "array", "dtype": "<f4", "ndim": 2}],
    }
    good = encode_fields([encode_array(np.zeros((2, 3), np.float32), np.dtype("<f4"))])
    assert decode_fields(memoryview(good), schema, "r", None)["a"].shape == (2, 3)
    for damaged in (
        good[:10],
        good[:4] + (10**9).to_bytes(8, "little") + good[12:],
        good[:12] + (10**12).to_bytes(8, "little") + good[20:],
        good[:-4],
    ):
        with pytest.raises(PackError, match="corrupt"):
            decode_fields(memoryview(damaged), schema, "r", None)


def test_without_image_fields_a_pose_file_packs_as_arrays(pose, tmp_path):
    target = tmp_path / "pose.h5pack.h5"
    pack(str(pose), target, workers=0)  # the path of an HDF5 file: its rows are the samples
    kinds = {field["name"]: field["kind"] for field in read_metadata(target)["schema"]["fields"]}
    assert kinds == {"image": "array", "part": "array", "S": "array", "imagename": "str"}
    want = h5py_rows(pose, POSE_FIELDS)
    assert_same_sample(HDF5Dataset(target)[7], want[7])


def test_a_pack_of_fields_read_in_the_parent_still_pickles(tmp_path):
    import pickle

    pack(Detection(3), tmp_path / "d.lmdb", store="raw", workers=0)
    dataset = LMDBDataset(tmp_path / "d.lmdb", decode="numpy")
    dataset[0]  # plans the reading (closures): spawn workers must still get the dataset
    copy = pickle.loads(pickle.dumps(dataset))
    _assert_detection_equal(copy[2], Detection(3)[2])


def test_the_crop_box_and_flip_of_a_fused_transform_come_with_the_sample(tmp_path):
    from fastloader import transforms

    source = Detection(3)
    pack(source, tmp_path / "d.lmdb", store="raw", workers=0)
    flip_crop = transforms.Compose([transforms.CenterCrop(8), transforms.RandomHorizontalFlip(1.0)])
    dataset = LMDBDataset(
        tmp_path / "d.lmdb", image_transform=flip_crop, decode="numpy", with_geometry=True
    )
    sample = dataset[1]
    geometry = sample["image_geometry"]
    assert geometry == {
        "left": 8.0,
        "top": 6.0,
        "width": 8.0,
        "height": 8.0,
        "out_height": 8,
        "out_width": 8,
        "flip": True,
        "source_height": 20,
        "source_width": 24,
    }
    stored = np.asarray(source[1]["image"])
    assert np.array_equal(sample["image"], stored[6:14, 8:16][:, ::-1])
    plain = LMDBDataset(tmp_path / "d.lmdb", decode="numpy", with_geometry=True)
    assert plain[0]["image_geometry"] is None  # no fused transform: nothing was cut
    with pytest.raises(ValueError, match="with_geometry is for packs of fields"):
        pack(ImageDataset(), tmp_path / "old.lmdb", workers=0)
        LMDBDataset(tmp_path / "old.lmdb", with_geometry=True)


def test_a_pack_of_a_pose_file_read_as_pil_says_which_decode_gives_arrays(pose, tmp_path):
    """decode="pil" (the default before format 5) gives PIL images, which no collate stacks:
    the loader's error names the field and the decode= that gives what the HDF5 file gave
    (arrays, the default now)."""
    target = tmp_path / "pose.lmdb"
    pack(HDF5File(pose), target, schema={"image": "image"}, store="raw", workers=0)
    with pytest.raises(TypeError, match=r"field 'image'.*decode='numpy'.*decode='tensor'"):
        next(iter(DataLoader(LMDBDataset(target, decode="pil"), batch_size=4)))
    batch = next(iter(DataLoader(LMDBDataset(target), batch_size=4)))
    assert batch["image"].shape == (4, *h5py_rows(pose, POSE_FIELDS)[0]["image"].shape)


def test_an_image_label_pack_without_a_transform_names_decode_too(tmp_path):
    pack(ImageDataset(), tmp_path / "images.lmdb", workers=0)
    with pytest.raises(
        TypeError, match=r"element 0 of each sample \(a tuple\).*decode='tensor'.*PILToTensor"
    ):
        next(iter(DataLoader(LMDBDataset(tmp_path / "images.lmdb"), batch_size=2)))
