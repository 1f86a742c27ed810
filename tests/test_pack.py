"""fastloader.pack: ImageFolder order, store modes, workers, bad input, atomic output."""

import importlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _images import (
    EXPECTED_CLASSES,
    EXPECTED_ORDER,
    ImageDataset,
    InterruptAt,
    Labelled,
    RecordsPids,
    make_folder_with_bad_files,
    make_image_folder,
    sixteen_bit,
    smooth_rgb,
)
from PIL import Image, ImageFile

from fastloader import PackError, PackSummary, open_pack, pack, read_metadata
from fastloader.formats import HDF5Writer, LMDBWriter, RecordKind
from fastloader.packing.worker import Options, encode_file, fit_within
from fastloader.vision.images import to_rgb

pack_module = importlib.import_module("fastloader.packing.pack")
SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images") / "src")


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    return make_folder_with_bad_files(tmp_path_factory.mktemp("bad") / "src")


def records(path: Path) -> list:
    """(label, kind, shape, payload bytes) of every record of a pack."""
    dataset = open_pack(path)
    out = []
    for index in range(len(dataset)):
        record = dataset.read_record(index)
        out.append((record.label, record.kind, record.shape, bytes(record.payload)))
    dataset.close()
    return out


def leftovers(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".partial-" in name)


def expected_rgb(path: Path) -> np.ndarray:
    """What a source file should unpack to: PIL's RGB, as torchvision's loader makes it."""
    return np.asarray(Image.open(path).convert("RGB"))


# --- scan ------------------------------------------------------------------------------------


def test_scan_lists_samples_in_imagefolder_order(folder):
    samples, classes = pack_module.scan_image_folder(folder)
    assert classes == EXPECTED_CLASSES
    assert [(str(Path(path).relative_to(folder)), label) for path, label in samples] == (
        EXPECTED_ORDER
    )


def test_scan_rejects_missing_empty_and_classless_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        pack_module.scan_image_folder(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError):
        pack_module.scan_image_folder(tmp_path / "file.txt")
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat/a.png")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        pack_module.scan_image_folder(tmp_path / "flat")
    for name in ("full", "hollow"):
        (tmp_path / "tree" / name).mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "tree/full/a.png")
    (tmp_path / "tree/hollow/readme.txt").write_text("no images here")
    with pytest.raises(FileNotFoundError, match="no image file for the classes hollow"):
        pack_module.scan_image_folder(tmp_path / "tree")


# --- store modes -----------------------------------------------------------------------------


@pytest.mark.parametrize("format", ["lmdb", "hdf5"])
def test_encoded_store_keeps_each_file_byte_for_byte(folder, tmp_path, format):
    target = tmp_path / f"out{SUFFIX[format]}"
    summary = pack(folder, target, workers=0)
    assert (summary.count, summary.format, summary.store, summary.skipped) == (
        13,
        format,
        "encoded",
        [],
    )
    assert summary.classes == EXPECTED_CLASSES
    assert summary.size_bytes == target.stat().st_size > 0
    stored = records(target)
    for (relative, label), (got_label, kind, _, payload) in zip(
        EXPECTED_ORDER, stored, strict=True
    ):
        assert (got_label, kind) == (label, RecordKind.ENCODED)
        assert payload == (folder / relative).read_bytes()
    metadata = read_metadata(target)
    assert (metadata["backend"], metadata["store"], metadata["count"]) == (format, "encoded", 13)
    assert metadata["info"]["source"] == str(folder)
    assert metadata["info"]["created_by"] == "fastloader-pack"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("format", ["lmdb", "hdf5"])
def test_raw_store_holds_the_rgb_pixels_of_every_image_mode(folder, tmp_path, format):
    target = tmp_path / f"out{SUFFIX[format]}"
    pack(folder, target, store="raw", workers=0)
    dataset = open_pack(target, decode="numpy")
    assert len(dataset) == len(EXPECTED_ORDER)
    for index, (relative, label) in enumerate(EXPECTED_ORDER):
        pixels, got_label = dataset[index]
        assert got_label == label
        assert pixels.shape == (24, 32, 3)
        np.testing.assert_array_equal(pixels, expected_rgb(folder / relative), err_msg=relative)


@pytest.mark.parametrize("store", ["raw", "encoded"])
def test_sixteen_bit_images_are_clipped_as_torchvision_clips_them(folder, tmp_path, store):
    pack(folder, tmp_path / "out.lmdb", store=store, workers=0)
    index = [relative for relative, _ in EXPECTED_ORDER].index("dog/deep16.png")
    pixels, _ = open_pack(tmp_path / "out.lmdb", decode="numpy")[index]
    np.testing.assert_array_equal(pixels[:, :, 0], np.minimum(sixteen_bit(), 255))
    wide = Image.fromarray(sixteen_bit().astype(np.int32), "I")
    np.testing.assert_array_equal(np.asarray(to_rgb(wide))[:, :, 1], np.minimum(sixteen_bit(), 255))


def test_jpeg_store_reencodes_close_to_the_source(folder, tmp_path):
    summary = pack(folder, tmp_path / "out.h5", store="jpeg", quality=92, workers=0)
    assert summary.store == "jpeg"
    assert read_metadata(tmp_path / "out.h5")["info"]["quality"] == 92
    dataset = open_pack(tmp_path / "out.h5", decode="numpy")
    for index, (relative, _) in enumerate(EXPECTED_ORDER):
        assert dataset.read_record(index).payload[:2] == b"\xff\xd8"  # a JPEG file
        pixels, _ = dataset[index]
        error = np.abs(pixels.astype(int) - expected_rgb(folder / relative)).mean()
        assert error < 6, relative


def test_max_side_shrinks_keeping_the_aspect_ratio_and_never_enlarges(folder, tmp_path):
    pack(folder, tmp_path / "small.lmdb", store="raw", max_side=16, workers=0)
    assert {shape for _, _, shape, _ in records(tmp_path / "small.lmdb")} == {(12, 16, 3)}
    pack(folder, tmp_path / "same.lmdb", store="jpeg", max_side=100, workers=0)
    assert open_pack(tmp_path / "same.lmdb")[0][0].size == (32, 24)
    tall = fit_within(Image.new("RGB", (10, 40)), 20)
    assert tall.size == (5, 20)
    assert read_metadata(tmp_path / "small.lmdb")["info"]["max_side"] == 16


def test_short_side_shrinks_the_shorter_side_like_torchvision_resize(folder, tmp_path):
    pack(folder, tmp_path / "short.h5", store="raw", short_side=12, workers=0)
    assert {shape for _, _, shape, _ in records(tmp_path / "short.h5")} == {(12, 16, 3)}
    assert read_metadata(tmp_path / "short.h5")["info"]["short_side"] == 12
    assert fit_within(Image.new("RGB", (10, 40)), None, 5).size == (5, 20)
    assert fit_within(Image.new("RGB", (10, 40)), 16, 5).size == (4, 16)  # both bounds hold
    assert fit_within(Image.new("RGB", (10, 40)), None, 50).size == (10, 40)  # never enlarged


# --- workers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["encoded", "jpeg"])
def test_two_workers_write_the_same_records_as_one(folder, tmp_path, store):
    pack(folder, tmp_path / "one.lmdb", store=store, workers=1)
    pack(folder, tmp_path / "two.lmdb", store=store, workers=2)
    assert records(tmp_path / "one.lmdb") == records(tmp_path / "two.lmdb")


def test_workers_decode_in_parallel_processes(tmp_path):
    (tmp_path / "pids").mkdir()
    dataset = RecordsPids(str(tmp_path / "pids"))
    pack(dataset, tmp_path / "out.lmdb", store="raw", workers=2)
    pids = {int(name) for name in os.listdir(tmp_path / "pids")}
    # the packer reads sample 0 in this process, to learn whether samples have fields
    assert len(pids - {os.getpid()}) == 2
    assert len(open_pack(tmp_path / "out.lmdb")) == len(dataset)


# --- bad input -------------------------------------------------------------------------------


def test_bad_files_are_skipped_counted_and_listed(bad_folder, tmp_path):
    summary = pack(bad_folder, tmp_path / "out.lmdb", workers=2)
    assert summary.count == 6
    reasons = {Path(path).name: reason for path, reason in summary.skipped}
    assert list(reasons) == ["empty.png", "text.jpg", "truncated.jpg"]
    assert reasons["empty.png"] == "empty file"
    assert "not an image" in reasons["text.jpg"]
    assert "truncated" in reasons["truncated.jpg"]
    text = str(summary)
    assert "skipped 3" in text and "truncated.jpg: damaged or truncated JPEG data" in text
    assert open_pack(tmp_path / "out.lmdb").targets.tolist() == [0, 0, 0, 1, 1, 1]


def test_skipped_count_is_stored_in_the_metadata(bad_folder, tmp_path):
    pack(bad_folder, tmp_path / "out.lmdb", workers=0)
    assert read_metadata(tmp_path / "out.lmdb")["info"]["skipped"] == 3


@pytest.mark.parametrize("store", ["encoded", "raw", "jpeg"])
def test_truncated_files_are_caught_even_if_pillow_allows_them(bad_folder, store, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    options = Options(store, 90, None)
    result = encode_file(str(bad_folder / "b/truncated.jpg"), 1, options)
    assert result.record is None and "truncated" in result.reason
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's setting is restored


def test_strict_fails_on_the_first_bad_file_and_writes_nothing(bad_folder, tmp_path):
    with pytest.raises(pack_module.BadImageError, match="empty.png: empty file"):
        pack(bad_folder, tmp_path / "out.lmdb", strict=True, workers=2)
    assert os.listdir(tmp_path) == []


def test_a_source_of_only_bad_files_is_an_error(tmp_path):
    (tmp_path / "src/a").mkdir(parents=True)
    (tmp_path / "src/a/x.jpg").write_text("text")
    with pytest.raises(ValueError, match="no image could be read"):
        pack(tmp_path / "src", tmp_path / "out.lmdb", workers=0)
    assert os.listdir(tmp_path) == ["src"]


def test_summary_lists_at_most_twenty_skipped():
    skipped = [(f"img{i}.jpg", "empty file") for i in range(25)]
    text = str(PackSummary(Path("x.lmdb"), "lmdb", "raw", 3, ["a"], skipped, 2048, 1.0))
    assert "img19.jpg: empty file" in text and "img20.jpg" not in text
    assert text.splitlines()[-1] == "  ... and 5 more"
    assert "2.0 KiB" in text


# --- options and targets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"store": "png"}, "store must be one of"),
        ({"format": "zip"}, "format must be one of"),
        ({"store": "jpeg", "quality": 0}, "quality"),
        ({"max_side": 64}, "max_side needs store='raw' or 'jpeg'"),
        ({"store": "raw", "max_side": 0}, "max_side must be a positive int"),
        ({"short_side": 64}, "short_side needs store='raw' or 'jpeg'"),
        ({"store": "jpeg", "short_side": -1}, "short_side must be a positive int"),
        ({"workers": -1}, "workers must be >= 0"),
    ],
)
def test_bad_options_are_rejected(folder, tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        pack(folder, tmp_path / "out.lmdb", **options)
    assert os.listdir(tmp_path) == []


def test_format_comes_from_the_suffix_or_the_option(folder, tmp_path):
    with pytest.raises(ValueError, match="cannot tell the format"):
        pack(folder, tmp_path / "out.bin")
    pack(folder, tmp_path / "out.bin", format="hdf5", workers=0)
    assert read_metadata(tmp_path / "out.bin")["backend"] == "hdf5"


def test_unwritable_targets_fail_before_any_work(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        pack(folder, tmp_path / "missing/out.lmdb")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        pack(folder, tmp_path / "file/out.lmdb")
    (tmp_path / "dir.lmdb").mkdir()
    with pytest.raises(IsADirectoryError):
        pack(folder, tmp_path / "dir.lmdb", overwrite=True)


def test_an_existing_target_is_replaced_only_with_overwrite(folder, tmp_path):
    target = tmp_path / "out.lmdb"
    target.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="--overwrite"):
        pack(folder, target, workers=0)
    assert target.read_bytes() == b"precious"
    pack(folder, target, workers=0, overwrite=True)
    assert len(open_pack(target)) == 13


# --- atomic output ---------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [LMDBWriter, HDF5Writer])
def test_a_failure_mid_run_leaves_no_file_and_keeps_the_old_one(
    folder, tmp_path, writer, monkeypatch
):
    suffix = ".lmdb" if writer is LMDBWriter else ".h5"
    original = writer.append

    def append(self, record, label, source=None):
        if self.count == 3:
            raise RuntimeError("disk on fire")
        original(self, record, label, source)

    monkeypatch.setattr(writer, "append", append)
    with pytest.raises(RuntimeError, match="disk on fire"):
        pack(folder, tmp_path / f"new{suffix}", workers=2)
    (tmp_path / f"old{suffix}").write_bytes(b"previous pack")
    with pytest.raises(RuntimeError, match="disk on fire"):
        pack(folder, tmp_path / f"old{suffix}", workers=0, overwrite=True)
    assert os.listdir(tmp_path) == [f"old{suffix}"]
    assert (tmp_path / f"old{suffix}").read_bytes() == b"previous pack"


@pytest.mark.parametrize("workers", [0, 2])
def test_keyboard_interrupt_leaves_no_file(tmp_path, workers):
    with pytest.raises(KeyboardInterrupt):
        pack(InterruptAt(5), tmp_path / "out.lmdb", workers=workers)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_a_killed_run_leaves_a_temp_file_that_never_opens(tmp_path, suffix):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _images import KillAt
        from fastloader import pack
        pack(KillAt(9, n=12), {str(tmp_path / ("out" + suffix))!r}, store="raw", workers=0)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert run.returncode == -9, run.stderr.decode()
    names = os.listdir(tmp_path)
    assert len(names) == 1 and names[0].startswith(f".out{suffix}.partial-")
    with pytest.raises(PackError):
        open_pack(tmp_path / names[0])


# --- datasets --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hwc", "hw", "pil", "png", "chw"])
def test_datasets_of_every_image_kind_pack_to_their_pixels(tmp_path, kind):
    dataset = ImageDataset(kind)
    summary = pack(dataset, tmp_path / "out.h5", store="raw", workers=0)
    assert (summary.count, summary.classes) == (6, ["even", "odd"])
    packed = open_pack(tmp_path / "out.h5", decode="numpy")
    for index in range(len(dataset)):
        pixels, label = packed[index]
        assert label == index % 2
        np.testing.assert_array_equal(pixels, dataset.pixels(index))
    assert read_metadata(tmp_path / "out.h5")["info"]["source"] == "_images.ImageDataset"


def test_encoded_store_keeps_bytes_and_stores_arrays_as_lossless_png(tmp_path):
    pack(ImageDataset("png"), tmp_path / "bytes.lmdb", workers=0)
    for index, (_, _, _, payload) in enumerate(records(tmp_path / "bytes.lmdb")):
        assert payload == ImageDataset("png")[index][0]
    pack(ImageDataset("hwc"), tmp_path / "arrays.lmdb", workers=0)
    for index, (_, kind, _, payload) in enumerate(records(tmp_path / "arrays.lmdb")):
        assert kind == RecordKind.ENCODED and payload[:8] == b"\x89PNG\r\n\x1a\n"
        np.testing.assert_array_equal(
            np.asarray(Image.open(io.BytesIO(payload))), smooth_rgb(index)
        )


def test_dataset_workers_write_the_same_records_as_the_main_process(tmp_path):
    pack(ImageDataset("pil", n=10), tmp_path / "zero.lmdb", store="jpeg", workers=0)
    pack(ImageDataset("pil", n=10), tmp_path / "two.lmdb", store="jpeg", workers=2)
    assert records(tmp_path / "zero.lmdb") == records(tmp_path / "two.lmdb")


@pytest.mark.parametrize(
    ("labels", "classes", "error", "message"),
    [
        ([0, 1, 2.5], None, TypeError, "sample 2: the label must be an int"),
        ([0, "cat"], None, TypeError, "sample 1"),
        ([0, True], None, TypeError, "sample 1"),
        ([0, 0, -1], None, ValueError, "sample 2: label -1"),
        ([0, 1, 2], ["a", "b"], ValueError, "sample 2: label 2 is not one of 2 classes"),
    ],
)
def test_bad_labels_are_errors_naming_the_sample(tmp_path, labels, classes, error, message):
    with pytest.raises(error, match=message):
        pack(Labelled(labels), tmp_path / "out.lmdb", classes=classes, workers=0)
    assert os.listdir(tmp_path) == []


def test_dataset_classes_default_to_the_label_names(tmp_path):
    labels = [0, np.int64(3), 1]
    assert pack(Labelled(labels), tmp_path / "a.lmdb").classes == ["0", "1", "2", "3"]
    assert pack(Labelled(labels, targets=True), tmp_path / "b.lmdb").classes[-1] == "3"
    named = pack(Labelled(labels), tmp_path / "c.lmdb", classes=["w", "x", "y", "z"])
    assert named.classes == ["w", "x", "y", "z"]
    assert open_pack(tmp_path / "c.lmdb").targets.tolist() == [0, 3, 1]


class _MixedBytes:
    classes = ["only"]

    def __len__(self):
        return 3

    def __getitem__(self, index):
        data = b"not an image" if index == 1 else ImageDataset("png")[index][0]
        return data, 0


def test_undecodable_dataset_bytes_are_skipped_by_index(tmp_path):
    summary = pack(_MixedBytes(), tmp_path / "out.lmdb", workers=0)
    assert summary.count == 2
    assert summary.skipped == [("1", "not an image file Pillow can read")]


def test_samples_that_are_not_images_are_errors(tmp_path):
    class Floats(Labelled):
        def __getitem__(self, index):
            return np.zeros((4, 4, 3), np.float32), 0

    with pytest.raises(TypeError, match=r"sample 0: the image must be .* got float32 \(4, 4, 3\)"):
        pack(Floats([0]), tmp_path / "out.lmdb", workers=0, classes=["a"])
    # without classes, (float array, int) samples are a pack of fields (tests/test_any_sample.py)
    assert open_pack(pack(Floats([0]), tmp_path / "fields.lmdb", workers=0).path).schema
    with pytest.raises(TypeError, match="source must be an image folder or a map-style dataset"):
        pack(42, tmp_path / "out.lmdb")
    with pytest.raises(ValueError, match="classes= is for datasets"):
        pack(tmp_path, tmp_path / "out.lmdb", classes=["a"])


@pytest.mark.parametrize("kind", ["JPEG", "PNG", "BMP"])
def test_check_image_accepts_whole_files_and_refuses_cut_ones(kind):
    from PIL import UnidentifiedImageError

    from fastloader.vision.images import check_image

    buffer = io.BytesIO()
    Image.fromarray(smooth_rgb(3)).save(buffer, kind)
    data = buffer.getvalue()
    check_image(data)
    for cut in (len(data) * 9 // 10, len(data) // 2):  # pixel data lost
        with pytest.raises(OSError):
            check_image(data[:cut])
    with pytest.raises(UnidentifiedImageError):
        check_image(b"GIF? no. " * 20)
