"""What packing promises about its inputs and outputs: damaged files are never admitted
silently (check="full"), and each sample's source path is recorded and read on demand."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from _images import EXPECTED_ORDER, ImageDataset, encode, make_image_folder
from PIL import Image

from fastloader import LMDBDataset, open_pack, pack, read_metadata
from fastloader.formats import open_writer

SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images") / "src")


def _noisy_jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(96, 128, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", quality=90)


def _damaged_in_the_middle(data: bytes, seed: int) -> bytes:
    """Overwrite 32 bytes in the middle of the entropy-coded data; start and end intact."""
    rng = np.random.default_rng(seed)
    middle = len(data) // 2
    return data[:middle] + rng.integers(0, 256, 32, dtype=np.uint8).tobytes() + data[middle + 32 :]


@pytest.mark.parametrize("store", ["encoded", "raw"])
def test_a_jpeg_damaged_in_the_middle_is_skipped_by_the_full_check(tmp_path, store):
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    (source / "a" / "good.jpg").write_bytes(_noisy_jpeg(0))
    damaged = None
    for seed in range(20):  # a damage that libjpeg reports (most are)
        candidate = _damaged_in_the_middle(_noisy_jpeg(1), seed)
        try:
            Image.open(__import__("io").BytesIO(candidate)).load()  # Pillow alone accepts it
        except OSError:
            continue
        damaged = candidate
        break
    assert damaged is not None
    (source / "a" / "bad.jpg").write_bytes(damaged)
    full = pack(source, tmp_path / "full.lmdb", store=store, workers=0)
    assert full.count == 1
    assert [(Path(where).name, reason.split(" (")[0]) for where, reason in full.skipped] == [
        ("bad.jpg", "damaged or truncated JPEG data")
    ]
    assert read_metadata(tmp_path / "full.lmdb")["info"]["check"] == "full"
    if store == "encoded":  # the quick check only looks at the header and the end marker
        quick = pack(source, tmp_path / "quick.lmdb", store=store, workers=0, check="quick")
        assert quick.count == 2 and quick.skipped == []
    with pytest.raises(ValueError, match="check must be one of full, quick"):
        pack(source, tmp_path / "x.lmdb", check="fast")


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_each_sample_records_its_source_path_relative_to_src(folder, tmp_path, fmt):
    path = tmp_path / f"out{SUFFIX[fmt]}"
    pack(folder, path, workers=0)
    dataset = open_pack(path)
    assert [dataset.source_path(i) for i in range(len(dataset))] == [
        os.path.normpath(name) for name, _ in EXPECTED_ORDER
    ]
    assert dataset.source_path(-1) == os.path.normpath(EXPECTED_ORDER[-1][0])
    with pytest.raises(IndexError):
        dataset.source_path(len(dataset))
    metadata = read_metadata(path)
    assert metadata["sources"] is True and metadata["first_source"] == "Bird/x.PNG"
    assert not hasattr(dataset, "sources")  # no list of paths is kept in memory


def test_skipped_files_shift_indices_and_source_path_says_where(tmp_path):
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    for name in ("0.png", "1.png", "2.png"):
        (source / "a" / name).write_bytes(encode(Image.new("RGB", (4, 4)), "PNG"))
    (source / "a" / "1.png").write_bytes(b"")
    pack(source, tmp_path / "p.lmdb", workers=0)
    dataset = LMDBDataset(tmp_path / "p.lmdb")
    assert [dataset.source_path(i) for i in range(len(dataset))] == ["a/0.png", "a/2.png"]


def test_a_pack_of_a_dataset_has_no_source_paths(tmp_path):
    pack(ImageDataset("hwc", n=3), tmp_path / "d.h5", workers=0, classes=["x", "y", "z"])
    dataset = open_pack(tmp_path / "d.h5")
    assert dataset.source_path(0) is None and read_metadata(tmp_path / "d.h5")["sources"] is False


def test_source_paths_are_all_or_none(tmp_path):
    from fastloader.formats import RecordKind, encode_record

    record = encode_record(b"x", 0, RecordKind.ENCODED)
    with pytest.raises(ValueError, match="either every record has a source path or none"):
        with open_writer(tmp_path / "w.lmdb", "lmdb", store="encoded", classes=["a"]) as writer:
            writer.append(record, 0, "a/1.png")
            writer.append(record, 0)
