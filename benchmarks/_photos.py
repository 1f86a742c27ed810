"""The suite's embedded dataset: realistic photos made at run time, nothing downloaded.

Images are random crops of the colour photos scikit-image ships with its wheel (astronaut,
coffee, chelsea, rocket, ...), one class per source photo, saved as JPEGs of ImageNet-like
size (about 500x375) in torchvision ``ImageFolder`` layout (``root/<class>/<n>.jpg``).
Without scikit-image, smooth synthetic NumPy images stand in for the photos (they compress
better than photos, so file sizes and decode times are lower; the result notes which was used).

Also here, shared by the comparisons that read the folder:

- :class:`ImageFolderDataset`: a minimal ``torchvision.datasets.ImageFolder`` (torchvision is
  not a dependency): the same class and label rules, a Python list of ``(path, label)`` samples,
  PIL decoding; the baseline every packed format is compared with;
- :class:`ResizeCenterCrop`: the evaluation transform (shorter side to 224, centre 224x224 crop,
  uint8 CHW tensor) for PIL images, uint8 HWC arrays and uint8 CHW tensors alike;
- :func:`packed`: the fastloader packs of a folder, made once per run and reused.
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from fastloader import pack

#: Colour photos bundled with scikit-image (no download); the order matters to ``photo_jpegs``.
PHOTO_NAMES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "motorcycle",
)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: Output sizes (width, height) of the folder's images, like the common ImageNet ones.
_IMAGE_SIZES = ((500, 375), (375, 500), (500, 333), (500, 400), (400, 400), (333, 500))
_DONE = ".complete"


@functools.lru_cache(maxsize=1)
def source_photos() -> tuple[str, dict[str, np.ndarray]]:
    """Return ``(kind, {name: uint8 HWC RGB photo})``: "scikit-image" photos, else "synthetic"."""
    try:
        from skimage import data
    except ImportError:
        return "synthetic", {f"synthetic{i}": _synthetic_photo(i) for i in range(6)}
    photos = {}
    for name in PHOTO_NAMES:
        if name == "motorcycle":
            photos[name] = data.stereo_motorcycle()[0]
        else:
            photos[name] = getattr(data, name)()
    return "scikit-image", photos


def _synthetic_photo(seed: int, height: int = 480, width: int = 640) -> np.ndarray:
    """A smooth, photo-like RGB image: upsampled low-frequency noise plus gradients and grain."""
    rng = np.random.default_rng(seed)
    layers = []
    for cells in (4, 12, 40):
        small = rng.integers(0, 256, (cells, cells * width // height, 3), dtype=np.uint8)
        big = Image.fromarray(small).resize((width, height), Image.BICUBIC)
        layers.append(np.asarray(big, dtype=np.float32))
    rows = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    image = 0.5 * layers[0] + 0.3 * layers[1] + 0.2 * layers[2] + 40 * (rows - 0.5)
    image += rng.normal(0, 4, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def photo_jpegs(count: int, side: int = 256, seed: int = 0) -> list[bytes]:
    """``count`` JPEGs of random ``side`` x ``side`` crops of the first four photos, in turn."""
    photos = list(source_photos()[1].values())[:4]
    rng = np.random.default_rng(seed)
    jpegs = []
    for i in range(count):
        photo = photos[i % len(photos)]
        top = rng.integers(0, photo.shape[0] - side)
        left = rng.integers(0, photo.shape[1] - side)
        buffer = io.BytesIO()
        Image.fromarray(photo[top : top + side, left : left + side]).save(buffer, "JPEG")
        jpegs.append(buffer.getvalue())
    return jpegs


def _random_view(photo: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A random crop of ``photo`` (35-100% of its area, a common aspect), resized and flipped."""
    width, height = _IMAGE_SIZES[rng.integers(len(_IMAGE_SIZES))]
    aspect = width / height
    photo_h, photo_w = photo.shape[:2]
    scale = np.sqrt(rng.uniform(0.35, 1.0))
    crop_h = int(min(photo_h, photo_w / aspect) * scale)
    crop_w = int(crop_h * aspect)
    top = rng.integers(0, photo_h - crop_h + 1)
    left = rng.integers(0, photo_w - crop_w + 1)
    view = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
    view = view.resize((width, height), Image.BILINEAR)
    return view.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else view


def make_image_folder(root: str | os.PathLike, count: int, seed: int = 0) -> Path:
    """Write ``count`` JPEG photos (quality 90) as ``root/<photo name>/<n>.jpg``; return root.

    Idempotent: a folder already completed by an earlier call with the same arguments is kept.
    """
    root = Path(root)
    done = root / _DONE
    stamp = f"{count} {seed} {source_photos()[0]}"
    if done.exists() and done.read_text() == stamp:
        return root
    photos = source_photos()[1]
    rng = np.random.default_rng(seed)
    names = list(photos)
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    for index in range(count):
        name = names[index % len(names)]
        _random_view(photos[name], rng).save(root / name / f"{index:06d}.jpg", quality=90)
    done.write_text(stamp)
    return root


def image_folder(workdir: str | os.PathLike, count: int) -> Path:
    """The run's image folder of ``count`` photos under ``workdir`` (made on first use)."""
    return make_image_folder(Path(workdir) / f"photos-{count}", count)


def folder_bytes(root: str | os.PathLike) -> int:
    """Total size of the image files under ``root``."""
    return sum(path.stat().st_size for path, _ in scan_image_folder(root)[0])


def scan_image_folder(root: str | os.PathLike) -> tuple[list[tuple[Path, int]], list[str]]:
    """``(samples, classes)`` with ``ImageFolder``'s rules: sorted class folders, sorted files."""
    root = Path(root)
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
            for file in sorted(files):
                if file.lower().endswith(IMG_EXTENSIONS):
                    samples.append((Path(folder) / file, label))
    return samples, classes


class ImageFolderDataset(Dataset):
    """A minimal ``torchvision.datasets.ImageFolder``: PIL-decodes ``root/<class>/<file>``.

    Like torchvision's, it keeps ``samples`` as a Python list of ``(path, label)`` tuples
    (whose reference counts, touched by every read, make forked workers' pages private).
    """

    def __init__(self, root: str | os.PathLike, transform: Any = None) -> None:
        self.root = Path(root)
        self.samples, self.classes = scan_image_folder(root)
        self.targets = [label for _, label in self.samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        with open(path, "rb") as file:
            image = Image.open(file).convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, label


class ResizeCenterCrop:
    """Shorter side to ``size`` (bilinear, antialiased), centre ``size`` x ``size`` crop.

    Accepts a PIL image (resized by PIL), a uint8 HWC array or a uint8 CHW tensor (resized by
    ``torch.nn.functional.interpolate``, no PIL); always returns a uint8 CHW tensor.
    """

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def __call__(self, image: Any) -> torch.Tensor:
        if isinstance(image, Image.Image):
            return self._pil(image)
        if isinstance(image, np.ndarray):
            with warnings.catch_warnings():  # read-only arrays are fine: only read from
                warnings.simplefilter("ignore", UserWarning)
                image = torch.from_numpy(image).permute(2, 0, 1)
        return self._tensor(image)

    def _pil(self, image: Image.Image) -> torch.Tensor:
        width, height = image.size
        scale = self.size / min(width, height)
        if scale != 1:
            new_size = (max(self.size, round(width * scale)), max(self.size, round(height * scale)))
            image = image.resize(new_size, Image.BILINEAR)
        width, height = image.size
        left, top = (width - self.size) // 2, (height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()

    def _tensor(self, image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[1:]
        scale = self.size / min(width, height)
        if scale != 1:
            new_size = (max(self.size, round(height * scale)), max(self.size, round(width * scale)))
            image = F.interpolate(
                image[None], size=new_size, mode="bilinear", antialias=True, align_corners=False
            )[0]
            height, width = new_size
        left, top = (width - self.size) // 2, (height - self.size) // 2
        return image[:, top : top + self.size, left : left + self.size].contiguous()


def packed(
    folder: Path, workdir: str | os.PathLike, format: str, store: str, short_side: int | None
) -> Any:
    """The path of the fastloader pack of ``folder`` in ``format``/``store`` (made once, reused).

    ``short_side`` applies to the ``raw`` and ``jpeg`` stores; ``encoded`` keeps the files as is.
    """
    suffix = {"lmdb": ".lmdb", "hdf5": ".h5"}[format]
    side = None if store == "encoded" else short_side
    path = Path(workdir) / "packs" / f"{folder.name}-{store}-{side}{suffix}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pack(folder, path, store=store, short_side=side, workers=2, progress=False)
    return path
