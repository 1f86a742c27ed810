"""Fused decoding: the same boxes and flips as the plain transform, close pixels, safe fallbacks."""

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

from fastloader import HDF5Dataset, ImageFolder, LMDBDataset, PackError, pack
from fastloader import transforms as T
from fastloader.vision import decoding

TRAIN = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
EVAL = T.Compose([T.Resize(80), T.CenterCrop(64), T.PILToTensor()])


class Plain:
    """The same transform, hidden from fusing."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        return self.transform(image)


def photo(seed: int, width: int = 200, height: int = 150) -> np.ndarray:
    """Photo-like pixels: smooth blobs at a few scales (upsampled noise), texture and grain."""
    rng = np.random.default_rng(seed)
    layers = []
    for cells, weight in ((4, 0.5), (12, 0.3), (40, 0.2)):
        small = rng.integers(0, 256, (cells, max(1, cells * width // height), 3), dtype=np.uint8)
        big = Image.fromarray(small).resize((width, height), Image.BICUBIC)
        layers.append(weight * np.asarray(big, dtype=np.float32))
    grain = rng.normal(0, 3, (height, width, 3))
    return np.clip(sum(layers) + grain, 0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def psnr(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    sizes = [(200, 150), (150, 200), (320, 240), (90, 70), (640, 480), (100, 100)]
    for index, (width, height) in enumerate(sizes):
        (root / f"c{index % 2}").mkdir(exist_ok=True)
        (root / f"c{index % 2}" / f"{index}.jpg").write_bytes(jpeg(photo(index, width, height)))
    Image.fromarray(photo(9, 120, 90)).save(root / "c0" / "png.png")
    return root


def _pairs(dataset_fused, dataset_plain, seeds=range(6)):
    for index in range(len(dataset_fused)):
        for seed in seeds:
            torch.manual_seed(seed)
            fused, label = dataset_fused[index]
            after_fused = torch.rand(1)
            torch.manual_seed(seed)
            plain, plain_label = dataset_plain[index]
            assert torch.equal(after_fused, torch.rand(1)), "fused draws differ in number"
            assert label == plain_label
            yield index, seed, fused, plain


@pytest.mark.parametrize("transform", [TRAIN, EVAL], ids=["train", "eval"])
def test_fused_folder_gives_the_plain_transforms_crops(folder, transform):
    fused, plain = ImageFolder(folder, transform), ImageFolder(folder, Plain(transform))
    assert decoding.fuse(fused.transform) is not None and decoding.fuse(plain.transform) is None
    scores = []
    for _, _, a, b in _pairs(fused, plain):
        assert a.dtype == torch.uint8 and a.shape == b.shape == (3, 64, 64)
        scores.append(psnr(a, b))
    # A different box or flip would score ~15 dB on these photos; rounding scores > 30.
    assert min(scores) > 25 and np.median(scores) >= 30


def test_resize_center_crop_quality_is_at_least_30_db_vs_pillow(folder):
    """Fused Resize(256)+CenterCrop(224) vs Pillow's bilinear resize of the full decode."""
    transform = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    scores = []
    for seed, size in enumerate([(500, 375), (375, 500), (1024, 768), (800, 800)]):
        data = jpeg(photo(seed, *size))
        fused = decoding.fuse(transform).apply_encoded(data, None, "pil")
        full = Image.open(io.BytesIO(data)).convert("RGB")
        scores.append(psnr(fused, transform(full)))
    assert np.median(scores) >= 30 and min(scores) >= 28


def test_large_jpegs_are_decoded_at_a_dct_scale(monkeypatch):
    if decoding.BACKEND != "simplejpeg":
        pytest.skip("simplejpeg/OpenCV not installed: the Pillow path is tested elsewhere")
    shapes = []
    real = decoding.simplejpeg.decode_jpeg
    monkeypatch.setattr(
        decoding.simplejpeg,
        "decode_jpeg",
        lambda *args, **kwargs: shapes.append(real(*args, **kwargs).shape) or real(*args, **kwargs),
    )
    data = jpeg(photo(1, 1024, 768))
    out = decoding.fuse(T.Compose([T.Resize(100), T.CenterCrop(96)])).apply_encoded(
        data, None, "pil"
    )
    assert out.size == (96, 96)
    assert shapes == [(192, 256, 3)]  # 1/4 scale: still >= 100 pixels on the short side


def test_pillow_backend_gives_the_same_crops_within_tolerance(folder, monkeypatch):
    fused = ImageFolder(folder, TRAIN)
    expected = {}
    for index in range(len(fused)):
        torch.manual_seed(index)
        expected[index] = fused[index][0]
    monkeypatch.setattr(decoding, "BACKEND", "pillow")
    for index in range(len(fused)):
        torch.manual_seed(index)
        assert psnr(fused[index][0], expected[index]) > 30


@pytest.mark.parametrize("store", ["encoded", "raw", "jpeg"])
@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_fused_packs_match_their_plain_transform(folder, tmp_path, store, backend):
    path = tmp_path / f"pack.{'lmdb' if backend == 'lmdb' else 'h5'}"
    pack(folder, path, store=store, short_side=120 if store != "encoded" else None, workers=1)
    Dataset = LMDBDataset if backend == "lmdb" else HDF5Dataset
    fused, plain = Dataset(path, transform=TRAIN), Dataset(path, transform=Plain(TRAIN))
    scores = [psnr(a, b) for _, _, a, b in _pairs(fused, plain, seeds=range(3))]
    assert min(scores) > 25 and np.median(scores) >= 30
    if store == "raw":  # raw records are cropped, not decoded: the same resize up to rounding
        assert np.median(scores) >= 35


@pytest.mark.parametrize("mode", ["pil", "tensor", "numpy"])
def test_fused_output_types_follow_the_decode_mode(folder, tmp_path, mode):
    path = tmp_path / "pack.lmdb"
    pack(folder, path, workers=1)
    crop_only = T.Compose([T.RandomResizedCrop(32), lambda image: image])
    unfused = LMDBDataset(path, transform=Plain(crop_only), decode=mode)[0][0]
    fused = LMDBDataset(path, transform=crop_only, decode=mode)[0][0]
    assert type(fused) is type(unfused)
    assert np.asarray(fused).shape == np.asarray(unfused).shape


def test_later_transforms_run_on_the_fused_result(folder):
    seen = []
    transform = T.Compose(
        [T.RandomResizedCrop(48), lambda im: seen.append(type(im)) or im, T.PILToTensor()]
    )
    image, _ = ImageFolder(folder, transform)[0]
    assert seen == [Image.Image] and image.shape == (3, 48, 48)
    chained = T.Compose([T.CenterCrop(40), T.PILToTensor(), lambda t: t.float().mean()])
    assert ImageFolder(folder, chained)[0][0].dtype == torch.float32


def test_non_jpeg_cmyk_and_padding_take_the_plain_path_exactly(folder, tmp_path):
    (tmp_path / "c").mkdir()
    Image.fromarray(photo(3, 120, 90)).save(tmp_path / "c" / "a.png")
    Image.fromarray(photo(4, 120, 90)).convert("CMYK").save(tmp_path / "c" / "b.jpg")
    Image.fromarray(photo(5, 40, 30)).save(tmp_path / "c" / "c.jpg")  # smaller than the crop
    transform = T.Compose([T.CenterCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()])
    fused, plain = ImageFolder(tmp_path, transform), ImageFolder(tmp_path, Plain(transform))
    for _, _, a, b in _pairs(fused, plain, seeds=range(3)):
        assert torch.equal(a, b)


def test_damaged_jpegs_raise_errors_naming_them(tmp_path):
    (tmp_path / "c").mkdir()
    whole = jpeg(photo(0))
    (tmp_path / "c" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "c" / "header-only.jpg").write_bytes(whole[:200])
    (tmp_path / "c" / "garbage.jpg").write_bytes(b"\xff\xd8\xff" + bytes(300))
    folder = ImageFolder(tmp_path, TRAIN)
    for index in range(len(folder)):
        with pytest.raises(OSError, match=folder.path(index).replace("\\", "\\\\")):
            folder[index]
    pack_path = tmp_path / "pack.lmdb"
    # Packing checks files; write the damaged ones straight into a pack.
    from fastloader.formats import LMDBWriter, RecordKind, encode_record

    with LMDBWriter(pack_path, store="encoded", classes=["c"]) as writer:
        writer.append(encode_record(whole[: len(whole) // 2], 0, RecordKind.ENCODED), 0)
    with pytest.raises(PackError, match="record 0"):
        LMDBDataset(pack_path, transform=TRAIN)[0]


def test_fused_loading_is_reproducible_for_any_num_workers(folder):
    from fastloader import DataLoader

    dataset = ImageFolder(folder, TRAIN)
    batches = []
    for workers in (0, 2):
        loader = DataLoader(dataset, batch_size=3, shuffle=True, num_workers=workers, seed=5)
        batches.append([images for images, _ in loader])
        if hasattr(loader, "close"):
            loader.close()
    assert len(batches[0]) == len(batches[1]) > 1
    for a, b in zip(*batches, strict=True):
        assert torch.equal(a, b)


def test_truncated_jpegs_are_refused_not_filled_in():
    whole = jpeg(photo(0))
    cut = whole[: len(whole) * 3 // 4]  # the header reads; the scan data stops

    def decode_plain():
        raise OSError("the plain decoder's error")

    for seed in range(5):  # boxes at the top (decodable rows) and bottom alike
        torch.manual_seed(seed)
        with pytest.raises(OSError, match="plain decoder"):
            decoding.fuse(TRAIN).apply_encoded(cut, decode_plain, "pil")


def test_fused_decoding_on_pillow_warns_once_naming_the_fast_extra(folder, monkeypatch):
    monkeypatch.setattr(decoding, "BACKEND", "pillow")  # as without OpenCV
    monkeypatch.setattr(decoding, "_fallback_warned", [])
    monkeypatch.setattr(decoding, "_CACHE", {})
    with pytest.warns(decoding.PillowFallbackWarning, match=r"install fastloader\[fast\]"):
        dataset = ImageFolder(folder, TRAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataset[0]
        ImageFolder(folder, EVAL)[0]  # another transform, the same process: once
        ImageFolder(folder, Plain(TRAIN))[0]  # nothing fused: nothing to say
    monkeypatch.setattr(decoding, "BACKEND", "simplejpeg")
    monkeypatch.setattr(decoding, "_fallback_warned", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageFolder(folder, T.Compose([T.Resize(50), T.PILToTensor()]))[0]


def test_a_missing_opencv_is_named_once_per_process(folder):
    """A fresh interpreter in which ``import cv2`` fails, as where the extra is not installed."""
    script = f"""
import sys, warnings
sys.modules["cv2"] = None  # import cv2 raises ImportError
warnings.simplefilter("always")
from fastloader import DataLoader, ImageFolder, transforms as T
from fastloader.vision import decoding
assert decoding.BACKEND == "pillow"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    train = T.Compose([T.RandomResizedCrop(32), T.PILToTensor()])
    batch = next(iter(DataLoader(ImageFolder({str(folder)!r}, train), batch_size=2)))
    ImageFolder({str(folder)!r}, T.Compose([T.Resize(40), T.PILToTensor()]))[0]
print(tuple(batch[0].shape))
for warning in caught:
    print(type(warning.message).__name__, warning.message)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "(2, 3, 32, 32)"  # fused decoding still works, on Pillow
    fallbacks = [line for line in lines[1:] if line.startswith("PillowFallbackWarning")]
    assert fallbacks == [
        "PillowFallbackWarning fastloader: OpenCV (cv2) is not installed, so fused decoding "
        "runs on Pillow, slower: pip install fastloader[fast]"
    ]
