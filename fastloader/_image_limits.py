"""Limits on one image, checked from its header before any decoder allocates.

Runs wherever images are checked (the packer's workers today); shared so that every path
refuses the same images as Pillow (see NOTE [ Per-image limits when packing ] in
``_pack_pool.py``).
"""

from __future__ import annotations

import io
import warnings

from PIL import Image


def check_pixels(data: bytes) -> None:
    """Raise Pillow's DecompressionBombError if the header of ``data`` declares more pixels
    than Pillow decodes: ``2 * Image.MAX_IMAGE_PIXELS``, read at call time (so a user's
    setting, or None for no limit, is followed), exactly where ``Image.open`` refuses. Between
    one and two times the limit Pillow only warns, and so does nothing here.

    Only the header is parsed (Pillow reads a JPEG's markers up to its first scan, a PNG's
    IHDR): nothing is decoded.

    Raises:
        PIL.Image.DecompressionBombError: for a bomb.
        PIL.UnidentifiedImageError: if the bytes are no image Pillow knows.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)):
            pass
