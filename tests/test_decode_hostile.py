"""Hostile images on every decode path: damaged scan data, bombs, 16-bit files, stderr noise.

Each test states what a user relies on: a file fails wherever torchvision's loader (Pillow)
fails, with the same exception class (or a subclass), on every crop the RNG can draw; bombs
are refused from the header before anything is decoded, with Pillow's limit and classes.
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastloader import ImageFolder, open_pack, pack
from fastloader import transforms as T
from fastloader.vision import decoding, images

# Crops of every kind on a 320x240 photo: full-scale random crops (boxes under twice the
# output: no DCT scale; the kind earlier versions region-decoded), DCT-scaled ones (a 1/4 or
# smaller scale) and the whole image at full scale.
CROPS = {
    "random crop, full scale": T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip()]),
    "random crop, any scale": T.Compose([T.RandomResizedCrop(32, scale=(0.05, 1.0))]),
    "DCT-scaled": T.Compose([T.Resize(60), T.CenterCrop(56)]),
    "whole image": T.Compose([T.Resize(240), T.PILToTensor()]),
}
SEEDS = range(24)


def photo(seed: int, width: int = 320, height: int = 240) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), np.float32)
    return np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, format: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format, **options)
    return buffer.getvalue()


def with_marker_in_scan_data(data: bytes) -> bytes:
    """A JPEG whose entropy-coded data has a stray marker halfway (its end marker intact):
    libjpeg's fatal error, Pillow's ``OSError: broken data stream``."""
    start = data.find(b"\xff\xda")
    middle = (start + len(data)) // 2
    return data[:middle] + b"\xff\xc0" + data[middle + 2 :]


def with_zeroed_scan_data(data: bytes) -> bytes:
    """A JPEG with 64 zero bytes in its entropy-coded data: libjpeg warns and Pillow loads it."""
    middle = (data.find(b"\xff\xda") + len(data)) // 2
    return data[:middle] + bytes(64) + data[middle + 64 :]


def torch_loader(path: Path) -> Image.Image:
    """torchvision's ``pil_loader``."""
    with open(path, "rb") as file:
        return Image.open(file).convert("RGB")


def damaged_folder(root: Path, progressive: bool) -> Path:
    (root / "a").mkdir(parents=True)
    good = encode(photo(1), quality=90, progressive=progressive)
    (root / "a" / "damaged.jpg").write_bytes(with_marker_in_scan_data(good))
    return root


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_damaged_scan_data_raises_oserror_on_every_crop_as_torch_does(tmp_path, progressive):
    root = damaged_folder(tmp_path / "src", progressive)
    path = root / "a" / "damaged.jpg"
    assert path.read_bytes().endswith(b"\xff\xd9")
    with pytest.raises(OSError):  # torchvision's ImageFolder
        torch_loader(path)
    for name, transform in CROPS.items():
        dataset = ImageFolder(root, transform)
        for seed in SEEDS:
            torch.manual_seed(seed)
            with pytest.raises(OSError, match="damaged.jpg"):
                dataset[0]
                pytest.fail(f"pixels from a damaged file: {name}, seed {seed}")
    with pytest.raises(OSError):
        ImageFolder(root)[0]  # transform=None


def test_packs_checked_quickly_refuse_damaged_scan_data_on_every_crop(tmp_path):
    root = damaged_folder(tmp_path / "src", progressive=False)
    good = encode(photo(2), quality=90)
    (root / "a" / "good.jpg").write_bytes(good)
    out = pack(root, tmp_path / "quick.lmdb", check="quick", workers=0)
    for transform in [*CROPS.values(), None]:
        for decode in ("pil", "tensor", "numpy"):
            dataset = open_pack(out.path, transform=transform, decode=decode)
            index = [dataset.source_path(i) for i in range(len(dataset))].index("a/damaged.jpg")
            for seed in SEEDS[:6]:
                torch.manual_seed(seed)
                with pytest.raises(OSError, match="record"):
                    dataset[index]
            dataset[1 - index]  # the good file still reads


def test_damage_pillow_tolerates_gives_pillows_pixels_on_every_crop(tmp_path):
    # libjpeg only warns: torchvision trains on what Pillow fills in; so does the fused path
    # (never different pixels, decoded differently per crop).
    data = with_zeroed_scan_data(encode(photo(3), quality=90))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "warned.jpg").write_bytes(data)
    reference = np.asarray(torch_loader(tmp_path / "a" / "warned.jpg"))
    for transform in CROPS.values():
        dataset = ImageFolder(tmp_path, transform)
        for seed in SEEDS[:8]:
            torch.manual_seed(seed)
            got = np.asarray(dataset[0][0])
            torch.manual_seed(seed)
            want = np.asarray(transform(Image.fromarray(reference)))
            assert _psnr(got, want) > 30


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


# --- decompression bombs ---------------------------------------------------------------------


def with_size(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF0/SOF2) declaring ``width`` x ``height``."""
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = data.find(marker)
        if at != -1:
            size = height.to_bytes(2, "big") + width.to_bytes(2, "big")
            return data[: at + 5] + size + data[at + 9 :]
    raise AssertionError("no frame header")


def _no_decoding(*args, **kwargs):
    raise AssertionError("a decoder ran on a bomb")


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_bombs_are_refused_from_the_header_with_pillows_error(tmp_path, monkeypatch, progressive):
    bomb = with_size(encode(photo(4, 16, 16), progressive=progressive), 65500, 65500)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bomb.jpg").write_bytes(bomb)
    with pytest.raises(Image.DecompressionBombError):  # torchvision
        torch_loader(tmp_path / "a" / "bomb.jpg")
    monkeypatch.setattr(decoding.simplejpeg, "decode_jpeg", _no_decoding)
    for transform in [*CROPS.values(), None]:
        with pytest.raises(Image.DecompressionBombError, match="bomb.jpg"):
            ImageFolder(tmp_path, transform)[0]
    for packers_helper in (images.check_jpeg, images.decode_image):
        with pytest.raises(Image.DecompressionBombError):
            packers_helper(bomb)


def test_pixel_limit_follows_pillows_setting_for_every_transform(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(encode(photo(5, 48, 40)))  # 1920 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # warn above 1000, refuse above 2000
    for transform in [*CROPS.values(), None]:
        with pytest.warns(Image.DecompressionBombWarning):
            ImageFolder(tmp_path, transform)[0]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 900)
    for transform in [*CROPS.values(), None]:
        with pytest.raises(Image.DecompressionBombError):
            ImageFolder(tmp_path, transform)[0]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for transform in [*CROPS.values(), None]:
            ImageFolder(tmp_path, transform)[0]


def test_check_pixel_limit_is_pillows_check(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    images.check_pixel_limit(10, 10, "fine.jpg")
    with pytest.warns(Image.DecompressionBombWarning, match="big.jpg"):
        images.check_pixel_limit(15, 10, "big.jpg")
    with pytest.raises(Image.DecompressionBombError, match="huge.jpg: Image size \\(201 pixels"):
        images.check_pixel_limit(201, 1, "huge.jpg")
    with pytest.raises(Image.DecompressionBombError):  # Pillow agrees on the boundary
        Image._decompression_bomb_check((201, 1))


_BOMB_CHILD = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # 13 GB would be needed
from PIL import Image
from fastloader import ImageFolder, transforms as T
dataset = ImageFolder(sys.argv[1], T.Compose([T.RandomResizedCrop(224), T.PILToTensor()]))
started = time.perf_counter()
try:
    dataset[0]
except Image.DecompressionBombError as error:
    print("refused in", round(time.perf_counter() - started, 3), "s:", error)
"""


def test_bomb_is_refused_in_a_memory_bounded_process(tmp_path):
    (tmp_path / "a").mkdir()
    bomb = with_size(encode(photo(6, 16, 16), progressive=True), 65500, 65500)
    (tmp_path / "a" / "bomb.jpg").write_bytes(bomb)
    assert len(bomb) < 1000
    done = subprocess.run(
        [sys.executable, "-c", _BOMB_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused in" in done.stdout and "bomb.jpg" in done.stdout


def with_repeated_scans(data: bytes, copies: int) -> bytes:
    """A progressive JPEG whose last scan is repeated ``copies`` times: a scan bomb."""
    last = data.rfind(b"\xff\xda")
    scan = data[last:-2]
    return data[:-2] + scan * copies + data[-2:]


def test_scan_bombs_are_refused_on_every_path(tmp_path, monkeypatch):
    normal = encode(photo(7), quality=90, progressive=True)
    assert images.count_jpeg_scans(normal) == normal.count(b"\xff\xda") > 1
    assert images.count_jpeg_scans(encode(photo(7), quality=90)) == 1
    bomb = with_repeated_scans(normal, 600)
    assert images.count_jpeg_scans(bomb) == images.count_jpeg_scans(normal) + 600
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "scans.jpg").write_bytes(bomb)
    monkeypatch.setattr(decoding.simplejpeg, "decode_jpeg", _no_decoding)
    for transform in [*CROPS.values(), None]:
        for catch in (OSError, Image.DecompressionBombError):
            with pytest.raises(catch, match="scans.jpg: progressive JPEG with more than 500"):
                ImageFolder(tmp_path, transform)[0]
    monkeypatch.undo()
    for packers_helper in (images.check_jpeg, images.decode_image):
        with pytest.raises(images.JPEGScanLimitError):
            packers_helper(bomb)
    monkeypatch.setattr(images, "MAX_JPEG_SCANS", None)  # a user who accepts them
    assert ImageFolder(tmp_path, CROPS["DCT-scaled"])[0][0].size == (56, 56)


def test_packed_scan_bombs_are_refused_when_read(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    bomb = with_repeated_scans(encode(photo(8), quality=90, progressive=True), 600)
    (tmp_path / "src" / "a" / "scans.jpg").write_bytes(bomb)
    out = pack(tmp_path / "src", tmp_path / "p.lmdb", check="quick", workers=0)
    for transform in [CROPS["DCT-scaled"], None]:
        with pytest.raises(images.JPEGScanLimitError, match="record"):
            open_pack(out.path, transform=transform)[0]


# --- no stderr noise -------------------------------------------------------------------------


_DECODE_CHILD = """
import sys
from fastloader import ImageFolder, transforms as T
dataset = ImageFolder(sys.argv[1], T.Compose([T.RandomResizedCrop(64), T.PILToTensor()]))
assert dataset[0][0].shape == (3, 64, 64)
"""


def test_a_fresh_process_decoding_fused_prints_nothing(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(encode(photo(9)))
    done = subprocess.run(
        [sys.executable, "-c", _DECODE_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == "" and done.stdout == ""


# --- 16-bit images ---------------------------------------------------------------------------


def sixteen_bit_files(root: Path) -> dict[str, np.ndarray]:
    """A 16-bit PNG holding 0-255 values and a 16-bit TIFF holding 12-bit values."""
    (root / "a").mkdir(parents=True)
    ramp = np.arange(40 * 64).reshape(40, 64)
    files = {"eight.png": (ramp % 256).astype(np.uint16), "twelve.tif": (ramp % 4096)}
    for name, values in files.items():
        Image.fromarray(values.astype(np.uint16)).save(root / "a" / name)
    return files


@pytest.mark.parametrize("store", ["raw", "encoded"])
def test_sixteen_bit_files_match_torchvision(tmp_path, store):
    files = sixteen_bit_files(tmp_path / "src")
    folder = ImageFolder(tmp_path / "src")
    packed = open_pack(pack(tmp_path / "src", tmp_path / "p.lmdb", store=store, workers=0).path)
    for index, (name, values) in enumerate(sorted(files.items())):
        want = np.asarray(torch_loader(tmp_path / "src" / "a" / name))
        np.testing.assert_array_equal(np.asarray(folder[index][0]), want)
        np.testing.assert_array_equal(np.asarray(packed[index][0]), want)
        if name == "eight.png":  # 0-255 values come out as they are, not black
            np.testing.assert_array_equal(want[:, :, 1], values)
        else:  # 12-bit values: Pillow clips at 255 (not near-black)
            np.testing.assert_array_equal(want[:, :, 0], np.minimum(values, 255))
            assert want.mean() > 200


def test_jpeg_helpers_need_no_decoder_for_the_scan_count():
    data = encode(photo(10), quality=90, progressive=True)
    view = memoryview(data)
    assert images.count_jpeg_scans(view) == images.count_jpeg_scans(data)
    assert images.count_jpeg_scans(data, stop_after=2) == 3
    images.check_jpeg_scans(b"not a jpeg at all")


def test_scan_data_fuzz_finds_no_difference_from_torch(tmp_path):
    from benchmarks import fuzz

    rng = np.random.default_rng(1)
    photos = fuzz.scan_photos()
    for trial in range(4):
        path = tmp_path / f"{trial}.jpg"
        path.write_bytes(fuzz.damage_scan_data(photos[trial % 2], rng))
        assert fuzz.judge_scan_damage(str(path)) == "same as torch"
