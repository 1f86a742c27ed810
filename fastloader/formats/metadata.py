"""The metadata schema shared by every backend: bounded JSON, every field checked.

Metadata is one JSON object; nothing in a pack is ever unpickled. A file from anyone may be
opened, so parsing is bounded before it starts (size and nesting depth), and every field is
type- and range-checked: any problem is a PackError naming the file.

NOTE [ Metadata checksums ]
The metadata carries the xxh3_64 checksums of the arrays a pack keeps beside its records
(``labels``, ``offsets`` and the source paths) under ``checksums``, and ``checksum``: the xxh3_64
of the canonical JSON (sorted keys, compact) of everything else. A reader re-serialises what it
parsed the same way to check it, so a flipped byte in a class name or a count is found too.
A pack of records written by this release also keeps ``records``: the xxh3_64 of every record's
header (``HEADER_SIZE`` bytes, its checksum bound to its position among them), in order. Each
record is checked against its own header as it is read, so without it nothing in the metadata
told one pack's records from another's: two packs of the same count, labels and record sizes
(samples of fields: their labels are all 0) had the same metadata, byte for byte. With it, the
metadata's ``checksum`` names the pack's contents: a sharded pack's manifest keeps it for each
shard and a shard is checked against it at every open (NOTE [ The shard manifest ] in
shards/manifest.py). A pack laid out by columns needs no such entry: its block checksums
(``sums``) are under ``checksums`` already and every block is checked against them before use.
Readers never require ``records`` (earlier packs lack it); ``--verify`` checks it where present.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from fastloader.formats.bounded_json import check_writable, parse_json
from fastloader.formats.column_layout import check_columns
from fastloader.formats.fields import check_schema
from fastloader.formats.records import (
    COLUMNS_VERSION,
    FIELDS_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    NEWEST_VERSION,
    STORE_MODES,
    UNBOUND_VERSION,
    PackError,
)

MAX_RECORDS = 1 << 40


def array_checksum(data: bytes | memoryview | np.ndarray) -> str:
    """The xxh3_64 of an array's bytes (little-endian as stored), as 16 hex digits."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data)).cast("B")
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def records_digest() -> Any:
    """A running xxh3_64 (``update``, ``hexdigest``): of a pack's record headers, in order, it
    is the ``records`` checksum (NOTE [ Metadata checksums ])."""
    return xxhash.xxh3_64()


def _canonical(metadata: dict[str, Any]) -> bytes:
    rest = {key: value for key, value in metadata.items() if key != "checksum"}
    return json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()


def make_metadata(
    backend: str,
    store: str,
    count: int,
    classes: Sequence[str],
    info: dict | None,
    checksums: dict[str, str],
    sources: bool,
    schema: dict[str, Any] | None = None,
    columns: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the metadata object a writer stores last, once every record is written.

    With ``schema`` (a pack of any sample, formats/fields.py) the pack is format 4; with
    ``columns`` too (NOTE [ Packs laid out by columns ] in column_layout.py) format 5.
    """
    version = FORMAT_VERSION if schema is None else FIELDS_VERSION
    metadata = {
        "format": FORMAT_NAME,
        "version": COLUMNS_VERSION if columns is not None else version,
        "backend": backend,
        "store": store,
        "count": int(count),
        "classes": [str(name) for name in classes],
        "info": dict(info or {}),
        "sources": bool(sources),
        "checksums": dict(checksums),
    }
    if schema is not None:
        metadata["schema"] = schema
    if columns is not None:
        metadata["columns"] = columns
    metadata["checksum"] = array_checksum(_canonical(metadata))
    return metadata


def dump_metadata(metadata: dict[str, Any]) -> bytes:
    """Serialise metadata to JSON bytes (raises TypeError for values JSON cannot hold, keys
    that are not str, or nesting deeper than the reader reads: a pack the reader refuses is
    never written)."""
    try:
        check_writable(metadata)
    except ValueError as error:
        raise TypeError(f"metadata (info=) that would not read back: {error}") from None
    return json.dumps(metadata, sort_keys=True).encode()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_metadata(raw: bytes | str | None, path: Path, backend: str) -> dict[str, Any]:
    """Parse and check the metadata of the pack at ``path``.

    Raises:
        PackError: naming the file, if the metadata is absent (an unfinished or foreign file),
            not ours, from another format version, damaged, or inconsistent.
    """
    if raw is None:
        raise PackError(
            f"{path}: not a complete fastloader pack (no metadata: an interrupted "
            f"fastloader-pack run, or a {backend} file written by something else)"
        )
    metadata = parse_json(raw, path)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise PackError(f"{path}: not a fastloader pack (foreign metadata)")
    version = _check_version(metadata.get("version"), path)
    stored = metadata.get("checksum")
    actual = array_checksum(_canonical(metadata))
    if stored != actual:
        raise PackError(
            f"{path}: damaged metadata (checksum mismatch: stored {str(stored)[:20]}, "
            f"computed {actual})"
        )
    problems = _problems(metadata, backend) + _parts_of_version(metadata, version)
    if problems:
        raise PackError(f"{path}: corrupt metadata ({'; '.join(problems)})")
    if "schema" in metadata:
        check_schema(metadata["schema"], path)
    if "columns" in metadata:
        check_columns(metadata, path)
    return metadata


def _check_version(version: Any, path: Path) -> int:
    if not _is_int(version) or version < 1:
        raise PackError(f"{path}: corrupt metadata (format version {str(version)[:40]!r})")
    if version > NEWEST_VERSION:
        raise PackError(
            f"{path}: written by a newer fastloader (format version {version}; this version "
            f"reads up to {NEWEST_VERSION}): upgrade fastloader"
        )
    if version < UNBOUND_VERSION:
        raise PackError(
            f"{path}: written by an older fastloader (format version {version}, records without "
            f"checksums): re-pack it with this version's fastloader-pack"
        )
    return version


def _parts_of_version(metadata: dict[str, Any], version: int) -> list[str]:
    """A schema from FIELDS_VERSION on, columns from COLUMNS_VERSION on, and not before."""
    problems = []
    for part, since in (("schema", FIELDS_VERSION), ("columns", COLUMNS_VERSION)):
        if (part in metadata) != (version >= since):
            problems.append(
                f"{part} in a pack of another version" if part in metadata else f"no {part}"
            )
    return problems


def _problems(metadata: dict[str, Any], backend: str) -> list[str]:
    problems = []
    if metadata.get("backend") != backend:
        problems.append(f"backend {str(metadata.get('backend'))[:40]!r} in a {backend} file")
    if metadata.get("store") not in STORE_MODES:
        problems.append(f"unknown store mode {str(metadata.get('store'))[:40]!r}")
    count = metadata.get("count")
    if not _is_int(count) or not 0 <= count <= MAX_RECORDS:
        problems.append(f"bad count {str(count)[:40]!r}")
    problems += _class_problems(metadata)
    if not isinstance(metadata.get("info"), dict):
        problems.append("info is not an object")
    if not isinstance(metadata.get("sources"), bool):
        problems.append("sources is not true or false")
    checksums = metadata.get("checksums")
    if not isinstance(checksums, dict) or not all(
        isinstance(value, str) for value in checksums.values()
    ):
        problems.append("checksums is not an object of strings")
    return problems


def _class_problems(metadata: dict[str, Any]) -> list[str]:
    classes = metadata.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return ["classes is not a list of names"]
    if not classes and "schema" not in metadata:
        return ["no classes"]
    if len(set(classes)) != len(classes):
        return ["class names repeat"]
    return []


def check_array(data: Any, name: str, metadata: dict[str, Any], path: Path) -> None:
    """Check an array kept beside the records against its checksum in the metadata.

    Raises:
        PackError: naming the file and the array, if it is missing from the metadata or differs.
    """
    stored = metadata["checksums"].get(name)
    if stored is None:
        raise PackError(f"{path}: corrupt metadata (no checksum for {name})")
    actual = array_checksum(data)
    if stored != actual:
        raise PackError(
            f"{path}: damaged {name} (checksum mismatch: stored {stored[:20]}, computed {actual})"
        )


def check_targets(targets: np.ndarray, metadata: dict[str, Any], path: Path) -> np.ndarray:
    """Return the int64 label array after checking it against the metadata.

    Raises:
        PackError: if its length differs from the record count, its checksum does not match,
            or a label is not one of the classes.
    """
    if targets.dtype != np.dtype("<i8") or targets.ndim != 1:
        raise PackError(f"{path}: corrupt pack (labels are {targets.dtype}, not int64)")
    if len(targets) != metadata["count"]:
        raise PackError(
            f"{path}: corrupt pack ({len(targets)} labels for {metadata['count']} records)"
        )
    check_array(targets, "labels", metadata, path)
    classes = len(metadata["classes"])
    if "schema" in metadata:  # a pack of any sample: no labels (all 0)
        if len(targets) and (targets.min() != 0 or targets.max() != 0):
            raise PackError(f"{path}: corrupt pack (labels in a pack of fields)")
        return targets.astype(np.int64, copy=False)
    if len(targets) and (targets.min() < 0 or targets.max() >= classes):
        raise PackError(f"{path}: corrupt pack (a label is outside the {classes} classes)")
    return targets.astype(np.int64, copy=False)


def human_size(size: float) -> str:
    """Return a byte count in binary units, e.g. ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
