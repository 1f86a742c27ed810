"""A pack record's image payload as the user asked for it: a PIL image, a tensor, an array, bytes.

Runs in whichever process reads a pack. Used by the pack datasets (datasets/packs.py) and by
samples of many fields (datasets/field_samples.py).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastloader.formats.records import PackError, Record, RecordKind
from fastloader.vision.decoding import channels_first, to_pil
from fastloader.vision.images import check_jpeg_scans, to_rgb

DECODE_MODES = ("pil", "tensor", "numpy", "bytes")


def decode_image(record: Record, mode: str, where: str = "record") -> Any:
    """Turn a record's payload into a PIL RGB image, a uint8 CHW tensor, a HWC array or bytes.

    Stored image files are converted to RGB as packing converts them (``images.to_rgb``:
    ``convert("RGB")``, as torchvision's loader).

    The result never refers to the file's memory, so it outlives the read transaction.

    Raises:
        StoredImageError: naming ``where`` if an encoded payload is not a decodable image (a
            PackError and an OSError, the class torchvision's loader raises).
        PIL.Image.DecompressionBombError: for a bomb (Pillow's pixel limit; too many JPEG
            scans: ``images.JPEGScanLimitError``).
    """
    if mode == "bytes":
        return bytes(record.payload)
    if record.kind is RecordKind.RAW:
        pixels = np.frombuffer(record.payload, dtype=np.uint8).reshape(record.shape)
        if mode == "tensor":
            return _chw_tensor(pixels)
        pixels = pixels.copy()
        if mode == "numpy":
            return pixels
        return to_pil(pixels)
    check_jpeg_scans(record.payload, where)
    with _decoding(where):
        image = Image.open(io.BytesIO(record.payload))
        image.load()  # inside the read transaction, and so that errors surface here
        image = to_rgb(image)
    if mode == "pil":
        return image
    if mode == "numpy":
        return np.array(image)
    return _chw_tensor(np.asarray(image))


def _chw_tensor(pixels: np.ndarray) -> torch.Tensor:
    # One copy, from the (maybe read-only) HWC pixels into a writable CHW array that owns its
    # memory (NOTE [ Channels-first once ] in decoding.py: OpenCV's split, not a transpose).
    return torch.from_numpy(channels_first(pixels))


class StoredImageError(PackError, OSError):
    """A stored image file that does not decode: a ``PackError`` naming the pack and record,
    and an ``OSError``, as torchvision's loader raises for the same file."""


@contextmanager
def _decoding(where: str) -> Iterator[None]:
    try:
        yield
    except Image.DecompressionBombError as error:  # Pillow's class, naming the record
        raise type(error)(f"{where}: {error}") from error
    except (OSError, SyntaxError, ValueError) as error:  # what PIL raises for a bad image
        raise StoredImageError(f"{where}: stored image does not decode ({error})") from error
