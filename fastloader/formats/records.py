"""The record codec and the metadata schema shared by every packed-file backend.

A record is a fixed 24-byte header followed by the payload::

    magic   2s   b"FL"
    kind    u8   0 = encoded image file bytes (JPEG, PNG, ...), 1 = raw uint8 HWC pixels
    chans   u8   channels of a raw record (0 for encoded)
    height  u32  rows of a raw record (0 for encoded)
    width   u32  columns of a raw record (0 for encoded)
    length  u32  payload length in bytes (detects truncation)
    label   i64  the class index

Metadata is one JSON object; nothing in a pack is ever unpickled.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

FORMAT_NAME = "fastloader-pack"
FORMAT_VERSION = 1
STORE_MODES = ("encoded", "raw", "jpeg")

_HEADER = struct.Struct("<2sBBIIIq")
_MAGIC = b"FL"


class PackError(ValueError):
    """A packed file is missing, truncated, foreign, incomplete, or from a newer fastloader."""


class RecordKind(IntEnum):
    """What a record's payload holds."""

    ENCODED = 0
    RAW = 1


class Record(NamedTuple):
    """One decoded record header and a view of its payload (valid while the buffer lives)."""

    label: int
    kind: RecordKind
    shape: tuple[int, int, int] | None
    payload: memoryview


def encode_record(
    payload: bytes | memoryview | np.ndarray,
    label: int,
    kind: RecordKind,
    shape: tuple[int, int, int] | None = None,
) -> bytes:
    """Return the bytes of one record.

    Args:
        payload: the image file bytes (ENCODED), or the uint8 HWC pixels (RAW) as bytes or as an
            array whose shape is then used.
        label: the class index.
        kind: what the payload holds.
        shape: (height, width, channels) of RAW pixels given as bytes.

    Raises:
        ValueError: if a RAW payload does not match its shape or is not uint8 HWC.
    """
    kind = RecordKind(kind)
    if isinstance(payload, np.ndarray):
        if kind is not RecordKind.RAW or payload.dtype != np.uint8 or payload.ndim != 3:
            raise ValueError(
                f"an array payload must be a uint8 HWC RAW record, got {payload.dtype} "
                f"{payload.shape} as {kind.name}"
            )
        shape = payload.shape
        payload = np.ascontiguousarray(payload).tobytes()
    length = len(payload)
    if kind is RecordKind.RAW:
        if shape is None or len(shape) != 3:
            raise ValueError("a RAW record needs its (height, width, channels) shape")
        if shape[0] * shape[1] * shape[2] != length:
            raise ValueError(f"RAW payload of {length} bytes does not match shape {tuple(shape)}")
        height, width, channels = shape
    else:
        height = width = channels = 0
    return _HEADER.pack(_MAGIC, kind, channels, height, width, length, int(label)) + bytes(payload)


def decode_record(buffer: bytes | memoryview, where: str = "record") -> Record:
    """Parse one record without copying its payload.

    Raises:
        PackError: naming ``where`` if the record is truncated or not a fastloader record.
    """
    view = memoryview(buffer)
    if len(view) < _HEADER.size:
        raise PackError(f"{where}: truncated record ({len(view)} bytes, header needs 24)")
    magic, kind, channels, height, width, length, label = _HEADER.unpack_from(view)
    if magic != _MAGIC or kind not in (RecordKind.ENCODED, RecordKind.RAW):
        raise PackError(f"{where}: not a fastloader record (bad header)")
    if len(view) - _HEADER.size != length:
        raise PackError(
            f"{where}: truncated record (payload {len(view) - _HEADER.size} of {length} bytes)"
        )
    shape = (height, width, channels) if kind == RecordKind.RAW else None
    if shape is not None and height * width * channels != length:
        raise PackError(f"{where}: corrupt record (shape {shape} does not match {length} bytes)")
    return Record(label, RecordKind(kind), shape, view[_HEADER.size :])


def make_metadata(
    backend: str, store: str, count: int, classes: Sequence[str], info: dict | None
) -> dict[str, Any]:
    """Return the metadata object a writer stores last, once every record is written."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "backend": backend,
        "store": store,
        "count": int(count),
        "classes": [str(name) for name in classes],
        "info": dict(info or {}),
    }


def dump_metadata(metadata: dict[str, Any]) -> bytes:
    """Serialise metadata to JSON bytes (raises TypeError for values JSON cannot hold)."""
    return json.dumps(metadata, sort_keys=True).encode()


def load_metadata(raw: bytes | str | None, path: Path, backend: str) -> dict[str, Any]:
    """Parse and check the metadata of the pack at ``path``.

    Raises:
        PackError: naming the file, if the metadata is absent (an unfinished or foreign file),
            not ours, from a newer format version, or inconsistent.
    """
    if raw is None:
        raise PackError(
            f"{path}: not a complete fastloader pack (no metadata: an interrupted "
            f"fastloader-pack run, or a {backend} file written by something else)"
        )
    try:
        metadata = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PackError(f"{path}: corrupt metadata ({error})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise PackError(f"{path}: not a fastloader pack (foreign metadata)")
    version = metadata.get("version")
    if not isinstance(version, int) or version < 1:
        raise PackError(f"{path}: corrupt metadata (format version {version!r})")
    if version > FORMAT_VERSION:
        raise PackError(
            f"{path}: written by a newer fastloader (format version {version}; this version "
            f"reads up to {FORMAT_VERSION}): upgrade fastloader"
        )
    problems = []
    if metadata.get("backend") != backend:
        problems.append(f"backend {metadata.get('backend')!r} in a {backend} file")
    if metadata.get("store") not in STORE_MODES:
        problems.append(f"unknown store mode {metadata.get('store')!r}")
    if not isinstance(metadata.get("count"), int) or metadata["count"] < 0:
        problems.append(f"bad count {metadata.get('count')!r}")
    classes = metadata.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        problems.append("classes is not a list of names")
    if problems:
        raise PackError(f"{path}: corrupt metadata ({'; '.join(problems)})")
    return metadata


def check_targets(targets: np.ndarray, metadata: dict[str, Any], path: Path) -> np.ndarray:
    """Return the int64 label array after checking it against the metadata.

    Raises:
        PackError: if its length differs from the record count or a label is out of range.
    """
    if len(targets) != metadata["count"]:
        raise PackError(
            f"{path}: corrupt pack ({len(targets)} labels for {metadata['count']} records)"
        )
    classes = len(metadata["classes"])
    if len(targets) and classes and (targets.min() < 0 or targets.max() >= classes):
        raise PackError(f"{path}: corrupt pack (a label is outside the {classes} classes)")
    return targets
