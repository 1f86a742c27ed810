"""The encode stage of packing: one sample in, the bytes of one record (or why not) out.

Runs in the packing worker processes (see NOTE [ Packing workers ]); packing/jobs.py scans
and packing/pack.py writes.
"""

from __future__ import annotations

import io
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from fastloader.formats import RecordKind, encode_record
from fastloader.formats.packfile import is_tensor
from fastloader.vision.image_limits import check_pixels
from fastloader.vision.images import (
    check_image,
    decode_image,
    is_jpeg,
    shrunk_size,
    strict_decoding,
    to_rgb,
)


@dataclass(frozen=True)
class Options:
    store: str
    quality: int
    max_side: int | None
    short_side: int | None = None
    check: str = "full"  # see NOTE [ Checking images when packing ]


class Encoded(NamedTuple):
    record: bytes | None  # None when skipped
    label: int
    reason: str | None  # why it was skipped


def fit_within(
    image: Image.Image, max_side: int | None, short_side: int | None = None
) -> Image.Image:
    """Shrink ``image`` (bicubic) to fit ``max_side``/``short_side`` (see ``shrunk_size``).

    Images already within the bounds, and any with no bound, are returned as they are.
    """
    size = shrunk_size(image.size, max_side, short_side)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def encode_image(image: Image.Image, label: int, options: Options) -> bytes:
    """Return the record of a decoded image: RGB pixels, RGB JPEG, or (store encoded) RGB PNG."""
    image = fit_within(to_rgb(image), options.max_side, options.short_side)
    if options.store == "raw":
        return encode_record(np.asarray(image), label, RecordKind.RAW)
    buffer = io.BytesIO()
    if options.store == "jpeg":
        image.save(buffer, "JPEG", quality=options.quality)
    else:
        image.save(buffer, "PNG")
    return encode_record(buffer.getvalue(), label, RecordKind.ENCODED)


def _encode_bytes(data: bytes, label: int, options: Options) -> bytes:
    # Bad files are found here: kept as they are, files are checked (check_image), otherwise
    # they are decoded. Bombs first: NOTE [ Per-image limits when packing ] in packing/pool.py.
    check_pixels(data)
    full = options.check == "full"
    if options.store == "encoded":
        _check_like_pillow(data, full)
        return encode_record(data, label, RecordKind.ENCODED)
    if full and is_jpeg(data):
        _check_like_pillow(data, full)
    image = decode_image(data, options.max_side, options.short_side)
    return encode_image(image, label, options)


# NOTE [ Pillow decides what is unreadable ]
# The packer must keep every image torchvision's ImageFolder loads, yet never admit pixels
# made from damaged data. The full check decodes JPEGs with libjpeg-turbo in strict mode (NOTE
# [ Checking images when packing ] in images.py), which turns every libjpeg warning into an
# error. Some warnings are about the file's structure, not its pixels (_harmless): a bad ICC
# marker, an unknown JFIF revision or Adobe transform code, TurboJPEG's "could not determine
# subsampling type" for a valid but unusual chroma subsampling, and extraneous bytes before a
# marker between segments, or before the end marker when they are padding (all 0x00 or 0xFF).
# For a JPEG refused only for one of those, Pillow's full decode (with truncated images refused,
# whatever the caller set) decides: a file it loads is packed, as torchvision would load it.
# Extraneous bytes of data before the end marker or a restart marker are what is left when
# damaged entropy-coded data throws the decoder off (measured: most damage in the middle of a
# file reads so); with a bad Huffman code, a premature end of a data segment or an inconsistent
# progression they mean damaged pixels, even where Pillow decodes them silently: those files
# stay skipped, with libjpeg's reason. The strict check runs first because it is fast (DCT
# scale 1/8) and settles nearly every file; Pillow's full decode runs only for the few with a
# harmless complaint.
_HARMLESS = ("bad ICC marker", "unknown JFIF revision", "Unknown Adobe color transform")
_EXTRANEOUS = re.compile(r"(\d+) extraneous bytes before marker 0x([0-9a-f]{2})")


def _harmless(reason: str, data: bytes) -> bool:
    if any(text in reason for text in _HARMLESS) or "subsampling" in reason.lower():
        return True
    extra = _EXTRANEOUS.search(reason)
    if extra is None:
        return False
    count, marker = int(extra[1]), int(extra[2], 16)
    if marker == 0xD9:  # the end marker: padding only
        return data.endswith(b"\xff\xd9") and not data[-2 - count : -2].strip(b"\x00\xff")
    return not 0xD0 <= marker <= 0xD7  # not inside the entropy-coded data (restart markers)


def _check_like_pillow(data: bytes, full: bool) -> None:
    """``check_image``, with Pillow as the judge of JPEGs the strict check refuses for a
    harmless reason (see NOTE [ Pillow decides what is unreadable ])."""
    try:
        check_image(data, full)
    except UnidentifiedImageError:
        raise
    except OSError as strict:
        if not (full and is_jpeg(data)) or not _harmless(str(strict), data):
            raise
        try:
            decode_image(data)
        except Exception:
            raise strict from None  # libjpeg's reason says more than Pillow's


def _reason(error: BaseException) -> str:
    """A one-line reason for a skipped input, the same in any process."""
    if isinstance(error, UnidentifiedImageError):
        return "not an image file Pillow can read"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, OSError) else f"{type(error).__name__}: {text}"


def encode_file(path: str, label: int, options: Options) -> Encoded:
    """Read one image file and return its record, or why it cannot be packed.

    Never raises for a bad file: unreadable, empty, truncated and non-image files come back with
    ``record=None`` and a reason.
    """
    try:
        with open(path, "rb") as file:
            data = file.read()
        if not data:
            return Encoded(None, label, "empty file")
        return Encoded(_encode_bytes(data, label, options), label, None)
    except Exception as error:
        return Encoded(None, label, _reason(error))


class FolderEncoder:
    """Encodes ``(path, label)`` items."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, item: tuple[str, int]) -> Encoded:
        return encode_file(item[0], item[1], self.options)


class DatasetEncoder:
    """Encodes the sample at a dataset index: images that fail to decode are skipped, samples
    of the wrong kind (not ``(image, int label)``) raise, naming the index."""

    def __init__(self, dataset: Any, options: Options, num_classes: int) -> None:
        self.dataset = dataset
        self.options = options
        self.num_classes = num_classes

    def __call__(self, index: int) -> Encoded:
        sample = self.dataset[index]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise TypeError(f"sample {index}: expected an (image, label) pair, got {type(sample)}")
        image = _as_image(sample[0], index)
        label = check_label(sample[1], index, self.num_classes)
        try:
            if isinstance(image, bytes):
                return Encoded(_encode_bytes(image, label, self.options), label, None)
            with strict_decoding():
                image.load()  # a lazily read image file may be bad
            return Encoded(encode_image(image, label, self.options), label, None)
        except Exception as error:
            return Encoded(None, label, _reason(error))


def check_label(label: Any, index: int, num_classes: int | None) -> int:
    if is_tensor(label) and label.numel() == 1:
        if not (
            label.is_floating_point()
            or label.is_complex()
            or label.dtype == sys.modules["torch"].bool
        ):
            label = label.item()
    if isinstance(label, np.integer):
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool):
        raise TypeError(f"sample {index}: the label must be an int, got {label!r}")
    if label < 0 or (num_classes is not None and label >= num_classes):
        raise ValueError(f"sample {index}: label {label} is not one of {num_classes} classes")
    return label


def _as_image(image: Any, index: int) -> Image.Image | bytes:
    """Return a PIL image, or encoded image bytes; arrays and tensors become images."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Image.Image):
        return image
    if is_tensor(image):
        image = image.detach().cpu()
        image = (image.permute(1, 2, 0) if image.ndim == 3 else image).numpy()  # CHW -> HWC
    if (
        not isinstance(image, np.ndarray)
        or image.dtype != np.uint8
        or image.ndim not in (2, 3)
        or (image.ndim == 3 and image.shape[2] not in (1, 3, 4))
    ):
        what = f"{image.dtype} {tuple(image.shape)}" if hasattr(image, "shape") else type(image)
        raise TypeError(
            f"sample {index}: the image must be a PIL image, encoded image bytes, a uint8 "
            f"array (HW or HWC) or a uint8 tensor (HW or CHW); got {what}"
        )
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(image))


# NOTE [ Packing workers ]
# Workers (fastloader/packing/pool.py) get chunks of a few samples and send each result back as
# it is done; the main process writes them in index order, with at most `4 * workers` chunks
# ahead of the writer, so memory stays bounded however slow the writer is. The encoder (with a
# dataset in it) reaches each worker once, when it starts. Workers ignore SIGINT: Ctrl-C is
# handled once, by the main process, which stops the workers and cleans up (see NOTE [ Atomic
# packing ]). An exception in the encoder (a sample of the wrong kind) is re-raised in the main
# process; an image that takes too long or kills its worker is skipped (NOTE [ Per-image limits
# when packing ]).

_worker_encoder: Callable[[Any], Encoded] | None = None


def start_worker(encoder: Callable[[Any], Encoded]) -> None:
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_encoder = encoder


def encode_one(item: Any) -> Encoded:
    """Encode one item with the encoder this worker was started with."""
    return _worker_encoder(item)
