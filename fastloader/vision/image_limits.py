"""Limits on one image, checked from its header before any decoder allocates.

Runs wherever images are checked (the packer's workers today); shared so that every path
refuses the same images as Pillow (see NOTE [ Per-image limits when packing ] in
``packing/pool.py``).
"""

from __future__ import annotations

import io
import warnings

import simplejpeg
from PIL import Image


def check_pixels(data: bytes) -> None:
    """Raise Pillow's DecompressionBombError if the header of ``data`` declares more pixels
    than Pillow decodes: ``2 * Image.MAX_IMAGE_PIXELS``, read at call time (so a user's
    setting, or None for no limit, is followed), exactly where ``Image.open`` refuses. Between
    one and two times the limit Pillow only warns, and so does nothing here.

    Only the header is parsed: a JPEG's frame header by libjpeg-turbo (2 us; Pillow's parser
    takes as long as checking a small JPEG at DCT scale 1/8), other formats by ``Image.open``,
    which reads their header and nothing more.

    Raises:
        PIL.Image.DecompressionBombError: for a bomb.
        PIL.UnidentifiedImageError: if a file that is not a JPEG is no image Pillow knows.
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return
    if data[:3] == b"\xff\xd8\xff":
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except (ValueError, RuntimeError):  # a header TurboJPEG refuses: ask Pillow
            pass
        else:
            if width * height > 2 * limit:  # Pillow's words, from Image._decompression_bomb_check
                raise Image.DecompressionBombError(
                    f"Image size ({width * height} pixels) exceeds limit of {2 * limit} "
                    "pixels, could be decompression bomb DOS attack."
                )
            return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)):
            pass
