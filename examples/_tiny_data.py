"""Tiny generated data for the examples: an image folder of small JPEGs, made in seconds.

Every example takes ``--data DIR`` (your own image folder, torchvision ``ImageFolder`` layout:
``DIR/<class>/<image>``); without it, it trains on the folder this module writes. Nothing is
downloaded.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("circle", "square", "stripes")
#: Where the examples' tiny data goes unless told otherwise.
DEFAULT_ROOT = Path(tempfile.gettempdir(), "fastloader-example-data")


def _picture(kind: str, rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A noisy picture of ``kind``: something a tiny model can tell apart in a few steps."""
    image = rng.integers(0, 60, (height, width, 3), dtype=np.uint8)
    colour = rng.integers(120, 256, 3, dtype=np.uint8)
    rows, cols = np.mgrid[0:height, 0:width]
    if kind == "circle":
        centre_y, centre_x = rng.integers(height // 4, 3 * height // 4), width // 2
        image[(rows - centre_y) ** 2 + (cols - centre_x) ** 2 < (min(height, width) // 3) ** 2] = (
            colour
        )
    elif kind == "square":
        top, left = rng.integers(0, height // 3), rng.integers(0, width // 3)
        image[top : top + height // 2, left : left + width // 2] = colour
    else:
        image[(rows // 6) % 2 == 0] = colour
    return image


def make_image_folder(
    root: str | Path | None = None, per_class: int = 16, size: tuple[int, int] = (72, 96)
) -> Path:
    """Write ``per_class`` JPEGs of ``size`` (height, width) for each of 3 classes; return root.

    Args:
        root: where to write (made if missing); default: ``DEFAULT_ROOT``.
        per_class: images per class.
        size: (height, width) of every image.
    """
    root = DEFAULT_ROOT if root is None else Path(root)
    rng = np.random.default_rng(0)  # the same pictures every time
    for kind in CLASSES:
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            picture = _picture(kind, rng, *size)
            path = folder / f"{index:04d}.jpg"
            partial = path.with_suffix(f".{os.getpid()}.partial")  # never a half-written JPEG
            Image.fromarray(picture).save(partial, format="JPEG", quality=90)
            os.replace(partial, path)
    return root
