"""Bounded JSON: text parsed only when its size and nesting depth are within fixed limits.

Every JSON a file holds (a pack's metadata, a sample's JSON field) is parsed here, so the limits
are one fact: the writers check against the same ``MAX_DEPTH`` before they write.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.records import PackError

MAX_METADATA_BYTES = 64 << 20  # a million class names fit many times over
MAX_DEPTH = 16  # our own metadata nests 3 deep
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _depth(raw: bytes) -> int:
    """The nesting depth of JSON text, found without parsing it (strings blanked out)."""
    skeleton = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    steps = np.zeros(len(skeleton), dtype=np.int64)
    steps[(skeleton == ord("[")) | (skeleton == ord("{"))] = 1
    steps[(skeleton == ord("]")) | (skeleton == ord("}"))] = -1
    return int(np.cumsum(steps).max()) if len(steps) else 0


def parse_json(raw: bytes | str, path: Path, what: str = "metadata") -> Any:
    """Parse bounded JSON: at most MAX_METADATA_BYTES and MAX_DEPTH deep.

    Raises:
        PackError: naming the file, for JSON that is too large, too deep, or invalid.
    """
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_METADATA_BYTES:
        raise PackError(f"{path}: corrupt {what} ({len(raw)} bytes, at most {MAX_METADATA_BYTES})")
    if _depth(raw) > MAX_DEPTH:
        raise PackError(f"{path}: corrupt {what} (JSON nested deeper than {MAX_DEPTH} levels)")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, huge numbers
        raise PackError(f"{path}: corrupt {what} ({' '.join(str(error).split())[:200]})") from None
