"""Turning image files into 8-bit RGB, the same way when packing and when reading a pack."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import simplejpeg
from PIL import Image, ImageFile

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


def looks_like_image_folder(path: str | os.PathLike, look_at: int = 200) -> bool:
    """Whether ``path`` is a folder of class folders holding images (``ImageFolder``'s layout),
    judged from at most ``look_at`` entries of its first class folders (cheap on a huge one)."""
    try:
        with os.scandir(path) as entries:
            first = itertools.islice(entries, look_at)
            folders = [entry.path for entry in first if entry.is_dir()]
        for folder in folders[:8]:
            with os.scandir(folder) as entries:
                names = (entry.name.lower() for entry in itertools.islice(entries, look_at))
                if any(name.endswith(IMG_EXTENSIONS) for name in names):
                    return True
    except OSError:
        return False
    return False


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
        PIL.Image.DecompressionBombError: for a bomb (NOTE [ Decompression bombs ]).
    """
    check_jpeg_scans(data)  # Pillow checks the pixel limit in Image.open
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
    """Raise OSError if libjpeg finds anything wrong in a JPEG.

    See NOTE [ Checking images when packing ].

    Bombs are refused from the header first (NOTE [ Decompression bombs ]).

    Raises:
        OSError: for damaged or truncated data.
        PIL.Image.DecompressionBombError: for too many pixels or scans (``check_image_limits``).
    """
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError) as error:
        reason = " ".join(str(error).split())
        raise OSError(f"damaged or truncated JPEG data (libjpeg: {reason})") from None
    check_image_limits(data, width, height)
    try:
        space = {"CMYK": "CMYK", "YCCK": "CMYK", "Gray": "GRAY"}.get(colorspace, "RGB")
        # min_height/min_width 1: the 1/8 scale (min_factor alone does not scale).
        simplejpeg.decode_jpeg(
            data, colorspace=space, min_height=1, min_width=1, min_factor=8, strict=True
        )
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
    """Convert any image to 8-bit RGB exactly as torchvision's loader does: ``convert("RGB")``.

    Grayscale, palette (with or without transparency), RGBA/LA (alpha dropped), CMYK and the
    other modes convert as Pillow converts them. 16-bit and 32-bit integer images (``I;16*``,
    ``I``) are clipped at 255, as Pillow (and so torchvision) clips them: a 16-bit file holding
    0-255 values keeps them; values above 255 saturate (see docs/decoding-safety.md).
    """
    if image.mode == "RGB":
        return image
    with strict_decoding():
        return image.convert("RGB")


# NOTE [ Decompression bombs ]
# A few hundred bytes of JPEG header can declare 65500 x 65500 pixels: decoding it allocates
# ~13 GB (progressive JPEGs keep every coefficient) before the first scan is read. Pillow
# refuses such files in ``Image.open`` (``Image.MAX_IMAGE_PIXELS``: a DecompressionBombWarning
# above the limit, a DecompressionBombError above twice it); every path that decodes without
# Pillow (the fused decode, the packer's checks) calls ``check_pixel_limit`` on the header's
# size first, so the limit is Pillow's, read at each call (a user who raises or clears it is
# followed), the same for every transform and for packing.
#
# A progressive JPEG can also hold thousands of tiny scans, each a pass over every block of
# the image: a 714 KB file with 20 000 scans decodes for minutes in libjpeg-turbo (Pillow,
# simplejpeg, torchvision alike: none bounds it). ``check_jpeg_scans`` counts the scans of a
# progressive JPEG from its markers (no decoding; ~40 us for a 50 KB photo, nothing for a
# baseline JPEG) and refuses more than ``MAX_JPEG_SCANS``: 500, the limit libjpeg-turbo's own
# fuzz targets set with ``TJPARAM_SCANLIMIT`` (real encoders write 10 or so).

#: The most scans a progressive JPEG may have (NOTE [ Decompression bombs ]); None: no limit.
MAX_JPEG_SCANS: int | None = 500


class JPEGScanLimitError(Image.DecompressionBombError, OSError):
    """A progressive JPEG with more scans than ``MAX_JPEG_SCANS``: a decode-time bomb.

    Both a ``PIL.Image.DecompressionBombError`` (a bomb) and an ``OSError`` (a file that does
    not decode, as torchvision's loader would raise for a damaged one).
    """


def check_pixel_limit(width: int, height: int, path: str | os.PathLike | None = None) -> None:
    """Refuse an image too large to decode, with Pillow's limit and Pillow's errors.

    The limit is ``PIL.Image.MAX_IMAGE_PIXELS`` as it is when called (None: no limit). See
    NOTE [ Decompression bombs ].

    Args:
        width: the image's width from its header.
        height: the image's height from its header.
        path: the file (or record) to name in the message.

    Raises:
        PIL.Image.DecompressionBombError: above twice the limit.

    Warns:
        PIL.Image.DecompressionBombWarning: above the limit (but not twice it).
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return
    pixels = max(1, int(width)) * max(1, int(height))
    if pixels <= limit:
        return
    where = f"{os.fspath(path)}: " if path is not None else ""
    if pixels > 2 * limit:
        raise Image.DecompressionBombError(
            f"{where}Image size ({pixels} pixels) exceeds limit of {2 * limit} pixels, "
            "could be decompression bomb DOS attack."
        )
    warnings.warn(
        f"{where}Image size ({pixels} pixels) exceeds limit of {limit} pixels, "
        "could be decompression bomb DOS attack.",
        Image.DecompressionBombWarning,
        stacklevel=2,
    )


# A marker after entropy-coded data: 0xFF then neither a stuffed 0x00, an RSTn nor a fill 0xFF.
_NEXT_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")
_PROGRESSIVE_FRAMES = frozenset((0xC2, 0xC6, 0xCA, 0xCE))  # SOF2, SOF6, SOF10, SOF14
_START_OF_SCAN = 0xDA


def count_jpeg_scans(data: Any, stop_after: int | None = None) -> int:
    """The number of scans (SOS markers) of a JPEG, read from its markers without decoding.

    A baseline (sequential) JPEG counts as its first scan only: its scans are bounded by its
    data. Counting stops early once past ``stop_after``. Damaged marker structure ends the
    count (the decoder reports it).
    """
    size, position, scans, progressive = len(data), 2, 0, False
    while position + 4 <= size:
        if data[position] != 0xFF:
            break
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
            continue
        if marker == 0xD9:  # EOI
            break
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            position += 2
            continue
        progressive |= marker in _PROGRESSIVE_FRAMES
        position += 2 + ((data[position + 2] << 8) | data[position + 3])
        if marker == _START_OF_SCAN:
            scans += 1
            if not progressive or (stop_after is not None and scans > stop_after):
                break
            following = _NEXT_MARKER.search(data, position)
            if following is None:
                break
            position = following.start()
    return scans


def check_jpeg_scans(data: Any, path: str | os.PathLike | None = None) -> None:
    """Refuse a progressive JPEG with more than ``MAX_JPEG_SCANS`` scans (a scan bomb).

    ``data`` is a JPEG file's bytes (any buffer); other data passes. See NOTE [ Decompression
    bombs ].

    Raises:
        JPEGScanLimitError: naming ``path``, if the JPEG has too many scans.
    """
    limit = MAX_JPEG_SCANS
    if limit is None or not is_jpeg(bytes(data[:3])):
        return
    scans = count_jpeg_scans(data, stop_after=limit)
    if scans > limit:
        where = f"{os.fspath(path)}: " if path is not None else ""
        raise JPEGScanLimitError(
            f"{where}progressive JPEG with more than {limit} scans (each a pass over the whole "
            "image: a decode-time bomb); raise fastloader.vision.images.MAX_JPEG_SCANS to accept it"
        )


def check_image_limits(data: Any, width: int, height: int, path: Any = None) -> None:
    """``check_pixel_limit`` and, for a JPEG, ``check_jpeg_scans``: before any decode.

    Raises:
        PIL.Image.DecompressionBombError: for too many pixels or (``JPEGScanLimitError``, also
            an OSError) too many scans.
    """
    check_pixel_limit(width, height, path)
    check_jpeg_scans(data, path)
