"""Byte sizes as users write them: ``64MB``, ``1.5GiB``, ``50GB``, or a plain number of bytes."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str, what: str = "size") -> int:
    """``value`` in bytes: an int, or a string such as ``"64MB"`` (powers of 1000) or
    ``"64MiB"`` (powers of 1024).

    Raises:
        ValueError: naming ``what``, for anything else or a size below one byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes or a string like '64MB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(
                f"{what} must be a number of bytes or a string like '64MB' or '2GiB', got {value!r}"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{what} must be at least 1 byte, got {value!r}")
    return size
