"""Packed-file readers and writers: round trips, fork safety, and honest errors on bad files."""

from __future__ import annotations

import io
import json
import multiprocessing
import pickle

import h5py
import lmdb
import numpy as np
import pytest
import torch
from PIL import Image

from fastloader import DataLoader, HDF5Dataset, LMDBDataset, PackError, open_pack, read_metadata
from fastloader.datasets.packs import DECODE_MODES
from fastloader.formats import (
    RecordKind,
    decode_record,
    encode_record,
    format_from_suffix,
    open_writer,
)
from fastloader.formats.metadata import _canonical, array_checksum
from fastloader.vision.transforms import CenterCrop, Compose, PILToTensor

FORMATS = {"lmdb": (".lmdb", LMDBDataset), "hdf5": (".h5", HDF5Dataset)}
CLASSES = ["cat", "dog", "fish"]


def _pixels(index: int) -> np.ndarray:
    rng = np.random.default_rng(index)
    return rng.integers(0, 256, size=(6 + index % 3, 8, 3), dtype=np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _write(path, fmt: str, store: str = "raw", count: int = 12, info=None) -> None:
    with open_writer(path, fmt, store=store, classes=CLASSES, info=info) as writer:
        for index in range(count):
            label = index % len(CLASSES)
            if store == "raw":
                record = encode_record(_pixels(index), label, RecordKind.RAW)
            else:
                record = encode_record(_png(_pixels(index)), label, RecordKind.ENCODED)
            writer.append(record, label)


@pytest.fixture(params=sorted(FORMATS))
def fmt(request):
    return request.param


@pytest.fixture
def pack_path(tmp_path, fmt):
    path = tmp_path / f"train{FORMATS[fmt][0]}"
    _write(path, fmt, info={"source": "fixture"})
    return path


@pytest.mark.parametrize("store", ["raw", "encoded"])
def test_every_decode_mode_returns_the_stored_pixels(tmp_path, fmt, store):
    path = tmp_path / f"p{FORMATS[fmt][0]}"
    _write(path, fmt, store=store)
    for index in (0, 4, 11):
        expected = _pixels(index)
        image, label = FORMATS[fmt][1](path)[index]
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), expected)
        assert label == index % 3
        tensor, _ = FORMATS[fmt][1](path, decode="tensor")[index]
        assert tensor.dtype == torch.uint8 and tensor.is_contiguous()
        np.testing.assert_array_equal(tensor.permute(1, 2, 0).numpy(), expected)
        array, _ = FORMATS[fmt][1](path, decode="numpy")[index]
        assert array.flags.writeable
        np.testing.assert_array_equal(array, expected)
        payload, _ = FORMATS[fmt][1](path, decode="bytes")[index]
        assert payload == (expected.tobytes() if store == "raw" else _png(expected))


def test_dataset_looks_like_image_folder(pack_path, fmt):
    dataset = open_pack(pack_path)
    assert type(dataset) is FORMATS[fmt][1]
    assert len(dataset) == 12
    assert dataset.classes == CLASSES
    assert dataset.class_to_idx == {"cat": 0, "dog": 1, "fish": 2}
    assert isinstance(dataset.targets, np.ndarray) and dataset.targets.dtype == np.int64
    assert dataset.targets.tolist() == [i % 3 for i in range(12)]
    assert dataset.store == "raw"
    assert read_metadata(pack_path)["info"] == {"source": "fixture"}
    assert read_metadata(pack_path)["count"] == 12


def test_transforms_and_batch_reads(pack_path, fmt):
    dataset = FORMATS[fmt][1](
        pack_path,
        transform=lambda image: np.asarray(image).sum(),
        target_transform=lambda label: CLASSES[label],
    )
    batch = dataset.__getitems__([5, 0, -1])
    assert batch == [dataset[5], dataset[0], dataset[11]]
    assert batch[0] == (int(_pixels(5).sum()), CLASSES[5 % 3])


def test_bad_index_and_decode_mode_are_rejected(pack_path, fmt):
    dataset = FORMATS[fmt][1](pack_path)
    with pytest.raises(IndexError, match="index 12 out of range"):
        dataset[12]
    with pytest.raises(TypeError, match="index must be an int"):
        dataset["3"]
    assert dataset[torch.tensor(2)][1] == 2
    with pytest.raises(ValueError, match="decode must be one of"):
        FORMATS[fmt][1](pack_path, decode="jpeg")


def test_pickled_dataset_holds_no_open_handle(pack_path, fmt):
    dataset = FORMATS[fmt][1](pack_path)
    dataset[0]
    assert dataset._handle is not None
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._handle is None
    np.testing.assert_array_equal(np.asarray(clone[3][0]), _pixels(3))


def test_two_datasets_over_one_file_in_one_process(pack_path, fmt):
    first, second = FORMATS[fmt][1](pack_path), FORMATS[fmt][1](pack_path)
    first[0], second[1]
    first.close()
    assert second[2][1] == 2 and first[3][1] == 0


def _pixel_sum(array: np.ndarray) -> int:
    return int(array.sum())


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_read_correctly_with_every_start_method(pack_path, fmt, method):
    dataset = FORMATS[fmt][1](pack_path, decode="numpy", transform=_pixel_sum)
    dataset[0]  # opened in the parent before the workers start: they must reopen
    expected = [(int(_pixels(i).sum()), i % 3) for i in range(12)]
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context(method),
    )
    with loader:
        for _ in range(2):
            assert [(int(a), int(b)) for a, b in loader] == expected


# --- bad files -------------------------------------------------------------------------------


def test_missing_file_names_it(tmp_path, fmt):
    path = tmp_path / f"absent{FORMATS[fmt][0]}"
    with pytest.raises(FileNotFoundError, match="absent"):
        FORMATS[fmt][1](path)
    with pytest.raises(FileNotFoundError, match="absent"):
        open_pack(path)


def test_truncated_file_is_refused(pack_path, fmt):
    data = pack_path.read_bytes()
    pack_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackError, match=f"{pack_path.name}.*(truncated|not a readable)"):
        FORMATS[fmt][1](pack_path)


def test_interrupted_write_never_opens_as_complete(tmp_path, fmt):
    path = tmp_path / f"partial{FORMATS[fmt][0]}"
    with pytest.raises(RuntimeError, match="stop"):
        with open_writer(path, fmt, store="raw", classes=CLASSES) as writer:
            writer.append(encode_record(_pixels(0), 0, RecordKind.RAW), 0)
            raise RuntimeError("stop")
    assert path.exists()
    with pytest.raises(PackError, match="partial.*not a complete fastloader pack"):
        open_pack(path)


def test_foreign_files_are_refused(tmp_path):
    foreign_lmdb = tmp_path / "other.lmdb"
    env = lmdb.open(str(foreign_lmdb), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"0", pickle.dumps("not ours"))
    env.close()
    foreign_h5 = tmp_path / "other.h5"
    with h5py.File(foreign_h5, "w") as file:
        file["images"] = np.zeros((2, 3))
    text = tmp_path / "notes.lmdb"
    text.write_text("hello\n" * 2000)
    for path in (foreign_lmdb, foreign_h5):
        with pytest.raises(PackError, match=f"{path.name}: not a complete fastloader pack"):
            open_pack(path)
    with pytest.raises(PackError, match="notes.lmdb: not a fastloader pack .named as an LMDB"):
        open_pack(text)
    with pytest.raises(PackError, match="notes.lmdb: not an LMDB file"):
        LMDBDataset(text)
    with pytest.raises(PackError, match="is a directory"):
        open_pack(tmp_path)


def _rewrite_metadata(path, fmt, change, reseal: bool = True) -> None:
    """Rewrite a pack's metadata JSON; ``reseal`` recomputes its checksum as a writer would."""

    def changed(raw: bytes) -> bytes:
        metadata = change(json.loads(raw))
        if reseal:
            metadata["checksum"] = array_checksum(_canonical(metadata))
        return json.dumps(metadata).encode()

    if fmt == "lmdb":
        env = lmdb.open(str(path), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            txn.put(b"__metadata__", changed(txn.get(b"__metadata__")))
        env.close()
    else:
        with h5py.File(path, "r+") as file:
            raw = changed(file["metadata"][()].tobytes())
            del file["metadata"]
            file["metadata"] = np.frombuffer(raw, dtype=np.uint8)


def test_other_format_versions_are_refused(pack_path, fmt):
    _rewrite_metadata(pack_path, fmt, lambda m: {**m, "version": 6})
    with pytest.raises(PackError, match="newer fastloader \\(format version 6"):
        open_pack(pack_path)
    _rewrite_metadata(pack_path, fmt, lambda m: {**m, "version": 1})
    with pytest.raises(PackError, match="older fastloader .format version 1.*re-pack it"):
        open_pack(pack_path)


def test_edited_metadata_fails_its_checksum(pack_path, fmt):
    _rewrite_metadata(pack_path, fmt, lambda m: {**m, "classes": ["cat", "dog", "fisH"]}, False)
    with pytest.raises(PackError, match="damaged metadata .checksum mismatch"):
        open_pack(pack_path)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: {**m, "format": "tfrecord"}, "foreign metadata"),
        (lambda m: {**m, "count": 13}, "13 records|offsets do not fit|do not fit the metadata"),
        (lambda m: {**m, "classes": ["cat"]}, "outside the 1 classes"),
        (lambda m: {**m, "classes": []}, "no classes"),
        (lambda m: {**m, "classes": ["cat", "cat", "dog"]}, "class names repeat"),
        (lambda m: {**m, "count": True}, "bad count .True"),
        (lambda m: {**m, "count": -1}, "bad count .-1"),
        (lambda m: {**m, "info": [1]}, "info is not an object"),
        (lambda m: {**m, "checksums": {**m["checksums"], "labels": "0" * 16}}, "damaged labels"),
        (lambda m: {**m, "store": "zip"}, "unknown store mode 'zip'"),
    ],
)
def test_inconsistent_metadata_is_refused(pack_path, fmt, change, problem):
    _rewrite_metadata(pack_path, fmt, change)
    with pytest.raises(PackError, match=problem):
        open_pack(pack_path)


def test_corrupt_record_names_the_record(tmp_path):
    path = tmp_path / "p.lmdb"
    _write(path, "lmdb")
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        key = (4).to_bytes(8, "big")
        txn.put(key, txn.get(key)[:-10])
        key = (5).to_bytes(8, "big")
        record = bytearray(txn.get(key))
        record[-1] ^= 1
        txn.put(key, bytes(record))
    env.close()
    dataset = LMDBDataset(path)
    assert dataset[3][1] == 0
    with pytest.raises(PackError, match="p.lmdb record 4: damaged record .checksum mismatch"):
        dataset[4]
    with pytest.raises(PackError, match="p.lmdb record 5: damaged record .checksum mismatch: st"):
        dataset[5]
    unchecked = LMDBDataset(path, verify_checksums=False)
    with pytest.raises(PackError, match="p.lmdb record 4: truncated record"):
        unchecked[4]
    assert unchecked[5][1] == 2  # read without the check: the flipped pixel goes unnoticed


# (what is damaged, record kind, byte offset in the record): the payload, the label, the shape
DAMAGES = [
    ("raw payload", "raw", -5),
    ("encoded payload", "encoded", 33),  # the PNG signature: the image no longer decodes
    ("label", "raw", 16),
    ("height", "raw", 4),
]


@pytest.mark.parametrize("what, store, offset", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_every_read_path_reports_the_checksum_mismatch_before_any_transform(
    tmp_path, what, store, offset
):
    # NOTE [ Checksum after the copy ]: the hash runs after the decode, but covers as much.
    path = tmp_path / "p.lmdb"
    _write(path, "lmdb", store=store, count=4)
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        key = (2).to_bytes(8, "big")
        record = bytearray(txn.get(key))
        record[offset] ^= 0x24
        txn.put(key, bytes(record))
    env.close()
    seen = []

    def spy(image):
        seen.append(image)
        return image

    readers = [LMDBDataset(path, transform=spy, decode=mode) for mode in DECODE_MODES]
    fused = Compose([CenterCrop(4), PILToTensor()])
    readers.append(LMDBDataset(path, transform=fused, target_transform=spy, decode="tensor"))
    for dataset in readers:
        assert dataset[1][1] == 1 and dataset[3][1] == 0  # the records around it are fine
        seen.clear()
        with pytest.raises(PackError, match=r"p.lmdb record 2: damaged record \(checksum mis"):
            dataset[2]
        with pytest.raises(PackError, match=r"p.lmdb record 2: damaged record \(checksum mis"):
            dataset.__getitems__([1, 2])
        assert len(seen) <= 1  # record 1 of the batch only: no transform saw record 2
        with pytest.raises(PackError, match=r"p.lmdb record 2: damaged record \(checksum mis"):
            dataset.read_record(2)


def test_undecodable_stored_image_names_the_record(tmp_path, fmt):
    path = tmp_path / f"p{FORMATS[fmt][0]}"
    with open_writer(path, fmt, store="encoded", classes=CLASSES) as writer:
        writer.append(encode_record(b"not an image", 0, RecordKind.ENCODED), 0)
    with pytest.raises(PackError, match="record 0: stored image does not decode"):
        open_pack(path)[0]
    assert open_pack(path, decode="bytes")[0] == (b"not an image", 0)


# --- writer and codec ----------------------------------------------------------------------------


def test_writer_refuses_existing_file_and_bad_arguments(pack_path, fmt, tmp_path):
    with pytest.raises(FileExistsError):
        open_writer(pack_path, fmt, store="raw", classes=CLASSES)
    with pytest.raises(ValueError, match="store must be one of"):
        open_writer(tmp_path / "x", fmt, store="png", classes=CLASSES)
    with pytest.raises(ValueError, match="format must be one of"):
        open_writer(tmp_path / "x", "zip", store="raw", classes=CLASSES)
    with pytest.raises(TypeError):
        open_writer(tmp_path / "y", fmt, store="raw", classes=CLASSES, info={"f": object()})


def test_format_is_found_by_content_not_suffix(tmp_path):
    path = tmp_path / "misnamed.lmdb"
    _write(path, "hdf5")
    assert type(open_pack(path)) is HDF5Dataset
    assert format_from_suffix("a/b.LMDB") == "lmdb" and format_from_suffix("x.hdf5") == "hdf5"
    with pytest.raises(ValueError, match="x.zip: cannot tell the format"):
        format_from_suffix("x.zip")


def test_record_codec_round_trip_and_errors():
    pixels = _pixels(1)
    record = decode_record(encode_record(pixels, 7, RecordKind.RAW))
    assert (record.label, record.kind, record.shape) == (7, RecordKind.RAW, pixels.shape)
    assert bytes(record.payload) == pixels.tobytes()
    assert decode_record(encode_record(b"abc", -1, RecordKind.ENCODED)).shape is None
    with pytest.raises(ValueError, match="does not match shape"):
        encode_record(b"abc", 0, RecordKind.RAW, shape=(2, 2, 3))
    with pytest.raises(ValueError, match="uint8 HWC"):
        encode_record(pixels.astype(np.float32), 0, RecordKind.RAW)
    with pytest.raises(PackError, match="checksum mismatch"):
        decode_record(b"X" * 40, where="here")
    with pytest.raises(PackError, match="not a fastloader record"):
        decode_record(b"X" * 40, where="here", verify=False)
    with pytest.raises(PackError, match="here: truncated record"):
        decode_record(b"FL", where="here")


def test_hdf5_records_are_read_from_a_memory_map(tmp_path):
    path = tmp_path / "p.h5"
    _write(path, "hdf5", store="raw")
    dataset = HDF5Dataset(path, decode="numpy")
    np.testing.assert_array_equal(dataset[5][0], _pixels(5))
    assert isinstance(dataset._handle.maps["records"], np.memmap)  # zero-copy, no chunk cache
    with h5py.File(path) as file:
        assert file["records"].chunks is None


def test_a_repacked_path_opens_the_new_file_while_the_old_dataset_lives(tmp_path, fmt):
    path = tmp_path / f"p{FORMATS[fmt][0]}"
    _write(path, fmt, count=12)
    old = FORMATS[fmt][1](path, decode="numpy")
    np.testing.assert_array_equal(old[0][0], _pixels(0))
    replacement = tmp_path / f"new{FORMATS[fmt][0]}"  # as pack(overwrite=True) does: rename
    with open_writer(replacement, fmt, store="raw", classes=CLASSES) as writer:
        for index in range(5):
            writer.append(encode_record(_pixels(100 + index), 1, RecordKind.RAW), 1)
    replacement.replace(path)
    new = FORMATS[fmt][1](path, decode="numpy")
    assert len(new) == 5 and new.targets.tolist() == [1] * 5
    np.testing.assert_array_equal(new[0][0], _pixels(100))
    np.testing.assert_array_equal(old[3][0], _pixels(3))  # the old one keeps its own file open
    old.close()  # reopening finds another file at its path: refused, not mixed
    with pytest.raises(PackError, match="the file changed since this dataset opened it"):
        old[0]


def test_a_damaged_record_read_by_a_worker_raises_pack_error_in_the_loop(tmp_path, fmt):
    path = tmp_path / f"p{FORMATS[fmt][0]}"
    _write(path, fmt)
    data = bytearray(path.read_bytes())
    at = data.find(_pixels(7).tobytes())
    data[at + 5] ^= 0xFF
    path.write_bytes(data)
    loader = DataLoader(FORMATS[fmt][1](path, decode="numpy"), batch_size=None, num_workers=1)
    with loader, pytest.raises(PackError, match=f"p{FORMATS[fmt][0]} record 7: damaged record"):
        list(loader)


def test_lmdb_maps_no_more_than_the_file(tmp_path):
    path = tmp_path / "p.lmdb"
    _write(path, "lmdb")  # written with a 1 TiB map size in its meta page
    dataset = LMDBDataset(path)
    dataset[0]
    handle = dataset._handle
    assert handle.env.info()["map_size"] <= path.stat().st_size


def test_a_record_verifies_only_at_the_position_it_was_bound_to():
    # NOTE [ Checksums bound to positions ]
    from fastloader.formats.records import bind_record, checksum_matches

    record = encode_record(np.full((2, 3, 3), 9, dtype=np.uint8), 1, RecordKind.RAW)
    bound = bind_record(record, 3)
    assert checksum_matches(bound, 3)
    assert not checksum_matches(bound, 4) and not checksum_matches(bound, 0)
    assert decode_record(bound, position=3).label == 1
    with pytest.raises(PackError, match="checksum mismatch"):
        decode_record(bound, where="r", position=4)
    with pytest.raises(ValueError, match="checksum does not match"):
        bind_record(bytes(bound), 5)  # only an unbound record from encode_record
