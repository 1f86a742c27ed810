"""Turning image files into 8-bit RGB, the same way when packing and when reading a pack."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import simplejpeg
from PIL import Image, ImageFile

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")

#: The file name endings of images in an image folder (torchvision's ``IMG_EXTENSIONS``).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def class_folder_files(folder: str, is_valid_file: Callable[[str], bool]) -> list[str]:
    """The valid files of one class folder in torchvision's ``ImageFolder`` order: walked
    recursively, following symlinks, in ``sorted(os.walk(...))`` order, names sorted within a
    folder."""
    return [
        path
        for directory, _, files in sorted(os.walk(folder, followlinks=True))
        for path in (os.path.join(directory, file) for file in sorted(files))
        if is_valid_file(path)
    ]


@contextlib.contextmanager
def strict_decoding() -> Iterator[None]:
    """Make Pillow raise on truncated files, whatever the caller set; hush its palette warning."""
    saved = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Palette images with Transparency", UserWarning)
            yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = saved


def shrunk_size(
    size: tuple[int, int], max_side: int | None = None, short_side: int | None = None
) -> tuple[int, int]:
    """The (width, height) that fits ``size`` within both bounds, keeping the aspect ratio.

    ``max_side`` bounds the longer side, ``short_side`` the shorter one (torchvision's
    ``Resize(n)``); images are only ever shrunk.
    """
    width, height = size
    scale = 1.0
    if max_side is not None:
        scale = min(scale, max_side / max(width, height))
    if short_side is not None:
        scale = min(scale, short_side / min(width, height))
    if scale >= 1.0:
        return size
    return max(1, round(width * scale)), max(1, round(height * scale))


def decode_image(
    data: bytes, max_side: int | None = None, short_side: int | None = None
) -> Image.Image:
    """Open image file bytes and decode every pixel.

    Given a size bound (see ``shrunk_size``), a JPEG is decoded at the smallest DCT scale (1/2,
    1/4 or 1/8) that is still at least that size: every byte of the file is still decoded, so
    truncation is still found, at a fraction of the cost. Other formats decode in full.

    Raises:
        PIL.UnidentifiedImageError: if the bytes are not an image Pillow reads.
        OSError: if the file is truncated or corrupt (even with Pillow's
            ``ImageFile.LOAD_TRUNCATED_IMAGES`` set).
    """
    with strict_decoding():
        image = Image.open(io.BytesIO(data))
        if max_side is not None or short_side is not None:
            image.draft(None, shrunk_size(image.size, max_side, short_side))
        image.load()
    return image


# The last bytes of a complete file: a JPEG's end-of-image marker, a PNG's IEND chunk.
JPEG_END = b"\xff\xd9"
_END_MARKERS = {"JPEG": JPEG_END, "PNG": b"IEND\xaeB`\x82"}


# NOTE [ Checking images when packing ]
# A damaged JPEG often decodes without an error: libjpeg reports "corrupt data" as a warning,
# fills in what it can, and Pillow ignores warnings, so a file damaged in its middle would be
# packed and train as garbage (or fail hours later). check="full" (the default) decodes every
# JPEG with libjpeg-turbo through simplejpeg with strict=True, which turns those warnings into
# errors, at the smallest DCT scale (1/8: every entropy-coded byte is still decoded, at about
# the cost of reading the file); other formats are decoded in full by Pillow. check="quick"
# only parses the header and looks for the end marker: it finds truncated files, not damage
# inside them.
CHECKS = ("full", "quick")


def check_jpeg(data: bytes) -> None:
    """Raise OSError if libjpeg finds anything wrong in a JPEG (NOTE [ Checking images ... ])."""
    try:
        _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        space = {"CMYK": "CMYK", "YCCK": "CMYK", "Gray": "GRAY"}.get(colorspace, "RGB")
        simplejpeg.decode_jpeg(data, colorspace=space, min_factor=8, strict=True)
    except (ValueError, RuntimeError) as error:
        reason = " ".join(str(error).split())
        raise OSError(f"damaged or truncated JPEG data (libjpeg: {reason})") from None


def is_jpeg(data: bytes) -> bool:
    """Whether ``data`` starts like a JPEG file (SOI marker)."""
    return data[:3] == b"\xff\xd8\xff"


def check_image(data: bytes, full: bool = True) -> None:
    """Raise unless ``data`` is a complete, undamaged image file Pillow can read.

    Args:
        data: the file's bytes.
        full: decode every byte (see NOTE [ Checking images when packing ]); False accepts a
            JPEG or PNG whose header parses and which ends with its end marker without decoding
            it (a truncated file has lost its end marker; damage inside is not found).

    Raises:
        PIL.UnidentifiedImageError, OSError: as ``decode_image``, or for damaged JPEG data.
    """
    if full and is_jpeg(data):
        check_jpeg(data)
        return
    if full:
        decode_image(data)
        return
    with strict_decoding():
        image = Image.open(io.BytesIO(data))
    marker = _END_MARKERS.get(image.format or "")
    if marker is None or not data.endswith(marker):
        decode_image(data, max_side=1)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any image to 8-bit RGB like torchvision's loader, but scale 16-bit images.

    Grayscale, palette (with or without transparency), RGBA/LA (alpha dropped), CMYK and the
    other modes go through ``convert("RGB")``; 16-bit images (``I;16*``, and ``I``, taken as
    holding 16-bit values) keep their top 8 bits instead of being clipped at 255.
    """
    if image.mode in _SIXTEEN_BIT_MODES:
        pixels = np.asarray(image)
        if image.mode == "I":
            pixels = np.clip(pixels, 0, 65535)
        image = Image.fromarray((pixels >> 8).astype(np.uint8))
    if image.mode == "RGB":
        return image
    with strict_decoding():
        return image.convert("RGB")
