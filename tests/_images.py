"""Small image folders and datasets for the packing tests (importable by worker processes)."""

import io
import os
import signal
import time
from pathlib import Path

import numpy as np
from PIL import Image

WIDTH, HEIGHT = 32, 24

# The fixture tree of `make_image_folder`, in the order torchvision's ImageFolder lists it:
# classes sorted ("Bird" < "cat"), folders in sorted(os.walk()) order ("cat/sub-x" comes before
# "cat/sub/deep" because "-" < "/"), names sorted ("Z.png" < "a.JPG"), a symlinked folder
# followed, non-image files and files outside class folders ignored.
EXPECTED_CLASSES = ["Bird", "cat", "dog"]
EXPECTED_ORDER = [
    ("Bird/x.PNG", 0),
    ("cat/Z.png", 1),
    ("cat/a.JPG", 1),
    ("cat/sub/c.jpeg", 1),
    ("cat/sub-x/d.png", 1),
    ("cat/sub/deep/e.bmp", 1),
    ("dog/cmyk.jpg", 2),
    ("dog/deep16.png", 2),
    ("dog/gray.pgm", 2),
    ("dog/palette.png", 2),
    ("dog/rgba.tif", 2),
    ("dog/w.webp", 2),
    ("dog/zlink/x.PNG", 2),
]


def smooth_rgb(seed: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """A smooth uint8 HWC image (gradients: JPEG keeps it close), different for each seed."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = [
        128 + 100 * np.sin(x / (5 + seed % 4) + seed),
        128 + 100 * np.cos(y / (4 + seed % 3) - seed),
        (x + y) * 255 / (width + height),
    ]
    return np.clip(np.stack(channels, axis=2), 0, 255).astype(np.uint8)


def sixteen_bit(width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """A uint16 HW ramp using the whole 16-bit range."""
    ramp = np.linspace(0, 65535, width * height).reshape(height, width)
    return ramp.astype(np.uint16)


def encode(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    return buffer.getvalue()


def _palette_with_transparency(seed: int) -> Image.Image:
    image = Image.fromarray(smooth_rgb(seed)).convert("P", palette=Image.Palette.ADAPTIVE)
    image.info["transparency"] = 0
    return image


def make_image_folder(root: Path) -> Path:
    """Write the tree described by EXPECTED_ORDER under ``root``; return ``root``."""
    for folder in ("Bird", "cat/sub/deep", "cat/sub-x", "dog"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    rgb = [Image.fromarray(smooth_rgb(seed)) for seed in range(8)]
    rgb[0].save(root / "Bird/x.PNG", "PNG")
    rgb[1].save(root / "cat/Z.png", "PNG")
    rgb[2].save(root / "cat/a.JPG", "JPEG", quality=95)
    rgb[3].save(root / "cat/sub/c.jpeg", "JPEG", quality=95)
    rgb[4].save(root / "cat/sub-x/d.png", "PNG")
    rgb[5].save(root / "cat/sub/deep/e.bmp", "BMP")
    rgb[6].convert("CMYK").save(root / "dog/cmyk.jpg", "JPEG", quality=95)
    Image.fromarray(sixteen_bit()).save(root / "dog/deep16.png", "PNG")
    rgb[7].convert("L").save(root / "dog/gray.pgm", "PPM")
    _palette_with_transparency(1).save(root / "dog/palette.png", "PNG", transparency=0)
    rgba = Image.fromarray(np.dstack([smooth_rgb(2), np.full((HEIGHT, WIDTH), 128, np.uint8)]))
    rgba.save(root / "dog/rgba.tif", "TIFF")
    rgb[3].save(root / "dog/w.webp", "WEBP", lossless=True)
    os.symlink("../Bird", root / "dog/zlink")
    (root / "cat/notes.txt").write_text("not an image, no image suffix: ignored")
    (root / "README.txt").write_text("outside the class folders: ignored")
    return root


def make_folder_with_bad_files(root: Path) -> Path:
    """Two classes with good images plus three bad ones in class ``b``."""
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for index in range(3):
            Image.fromarray(smooth_rgb(index)).save(root / name / f"{index}.png")
    (root / "b/text.jpg").write_text("this is not a JPEG")
    (root / "b/empty.png").write_bytes(b"")
    whole = encode(Image.fromarray(smooth_rgb(5, 64, 48)), "JPEG", quality=95)
    (root / "b/truncated.jpg").write_bytes(whole[: len(whole) * 6 // 10])
    return root


class ImageDataset:
    """A map-style dataset of (image, label) with images of several kinds."""

    classes = ["even", "odd"]

    def __init__(self, kind: str = "hwc", n: int = 6) -> None:
        self.kind = kind
        self.n = n

    def __len__(self) -> int:
        return self.n

    def pixels(self, index: int) -> np.ndarray:
        """The RGB pixels sample ``index`` should unpack to."""
        pixels = smooth_rgb(index)
        return np.repeat(pixels[:, :, :1], 3, axis=2) if self.kind == "hw" else pixels

    def __getitem__(self, index: int):
        pixels = smooth_rgb(index)
        image = {
            "hwc": lambda: pixels,
            "hw": lambda: pixels[:, :, 0].copy(),
            "pil": lambda: Image.fromarray(pixels),
            "png": lambda: encode(Image.fromarray(pixels), "PNG"),
            "chw": lambda: __import__("torch").from_numpy(pixels.transpose(2, 0, 1).copy()),
        }[self.kind]()
        return image, index % 2


class Labelled:
    """Samples with the given labels (and no ``classes``), images of 8x8 pixels."""

    def __init__(self, labels: list, targets: bool = False) -> None:
        self.labels = labels
        if targets:
            self.targets = list(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return np.full((8, 8, 3), index, np.uint8), self.labels[index]


class InterruptAt(ImageDataset):
    """Raises KeyboardInterrupt when loading sample ``at``, as Ctrl-C would."""

    def __init__(self, at: int, n: int = 12) -> None:
        super().__init__("hwc", n)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            raise KeyboardInterrupt
        return super().__getitem__(index)


class KillAt(ImageDataset):
    """Kills its own process (SIGKILL: nothing can clean up) when loading sample ``at``."""

    def __init__(self, at: int, n: int = 12) -> None:
        super().__init__("hwc", n)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class RecordsPids(ImageDataset):
    """Leaves a file named after the loading process's pid in ``folder`` for each sample."""

    def __init__(self, folder: str, n: int = 16) -> None:
        super().__init__("hwc", n)
        self.folder = folder

    def __getitem__(self, index: int):
        Path(self.folder, str(os.getpid())).touch()
        time.sleep(0.01)
        return super().__getitem__(index)
