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


def dump_exact(value: Any) -> bytes:
    """JSON text of ``value`` that ``parse_json`` gives back equal to it, or a ValueError.

    What JSON would change is refused rather than stored changed: dict keys that are not str
    (``{1: "a"}`` would come back ``{"1": "a"}``), tuples (they come back lists), NaN and
    infinities, and nesting deeper than ``MAX_DEPTH`` (the reader's limit). Values JSON cannot
    hold at all raise too (TypeError from ``json.dumps`` becomes ValueError).

    Raises:
        ValueError: naming where in ``value`` (``["boxes"][2]``) and what is wrong.
    """
    _check_exact(value, "", 0, tuples=False)
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise ValueError(f"not JSON-able ({error})") from None


def check_writable(value: Any) -> None:
    """Raise ValueError, as ``dump_exact`` does, for dict keys that are not str or nesting
    deeper than ``MAX_DEPTH``; tuples are let through (they are written as lists)."""
    _check_exact(value, "", 0, tuples=True)


def _check_exact(value: Any, where: str, depth: int, *, tuples: bool) -> None:
    if isinstance(value, (dict, list, tuple)):
        depth += 1
        if depth > MAX_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels (at {where or 'top'})")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"dict key {key!r} ({type(key).__name__}) at {where or 'top'}: JSON keys "
                    f"are str, it would come back {json.dumps(str(key))}"
                )
            _check_exact(item, f"{where}[{key!r}]", depth, tuples=tuples)
    elif isinstance(value, tuple) and not tuples:
        raise ValueError(f"a tuple at {where or 'top'}: JSON has lists, it would come back one")
    elif isinstance(value, (list, tuple)):
        for at, item in enumerate(value):
            _check_exact(item, f"{where}[{at}]", depth, tuples=tuples)
