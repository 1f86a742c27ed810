"""The manifest of a sharded pack: which shards, how many samples each, their sizes and checksums.

NOTE [ The shard manifest ]
A sharded pack is a folder (or an object-store prefix) of ordinary packs, the shards, plus
``manifest.json``::

    {"format": "fastloader-shards", "version": 1, "backend": "lmdb", "store": "encoded",
     "count": 2000, "classes": [...], "schema": null, "created_by": "fastloader-pack",
     "shards": [{"name": "shard-00000.lmdb", "count": 1000, "bytes": 67108864,
                 "xxh3_64": "9f86d081884c7d65", "metadata_xxh3_64": "3c2a0e5b7d9f1a44"}, ...]}

``xxh3_64`` is the XXH3-64 digest of the shard file's bytes, checked after every download and
by ``--verify``; inside each shard, records keep their own checksums. ``metadata_xxh3_64`` is
the shard's metadata ``checksum``, checked at every open (NOTE [ Shard fingerprints ]). The
manifest is written LAST and atomically (a temporary name renamed, or one PUT), so a killed or
failed packer never leaves a sharded pack that opens. It is untrusted input when read: its
size and depth are bounded (formats/bounded_json.py), and every field is checked before
anything is used — names that could leave the folder, absurd counts or sizes, a newer version
— each refused by a ``ManifestError`` naming the field.

NOTE [ Shard fingerprints ]
A folder of shards is read in place, so the whole-file digest is not checked when a shard is
opened (hashing 64 MB on a shared file system at every open costs more than the read). A shard
replaced before it is opened by another pack's shard of the same size, count, schema and
classes was read as it was: wrong samples, silently (issue 37). So the packer keeps, per shard,
``metadata_xxh3_64``: the ``checksum`` of the shard's metadata, which the reader has already
recomputed and checked when it opened the pack (NOTE [ Metadata checksums ] in
formats/metadata.py); comparing it (``Shard.fingerprint_problem``, called where a shard is
opened) costs about 0.15 us, against 3-4 ms for the open. It pins what is read: the metadata
holds the checksums of the labels, offsets and source paths; of a pack laid out by columns, the
checksums of every block of rows (``sums``, checked at open, and every block checked against
them before its rows are used); of a pack of records, the checksum of every record's header,
each header holding its record's checksum (NOTE [ Metadata checksums ]). Another pack's shard
has another metadata checksum unless its contents are the same. What it does not catch: a file
made by splicing one pack's metadata onto another's records (every record still passes its own
checksum; only ``--verify`` finds it, by the whole-file digest), and anything made to collide
with XXH3-64 on purpose: these are checks against accidents, not a signature. The field is
optional: manifests of the previous release have none (their shards are checked as before), and
that release ignores it, so the version stays 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from fastloader.formats import FORMATS, PackError
from fastloader.formats.bounded_json import dump_exact, parse_json

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "ManifestError",
    "Shard",
    "file_checksum",
    "parse_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "fastloader-shards"
MANIFEST_VERSION = 1
MAX_SHARDS = 10_000_000
MAX_SHARD_SAMPLES = 1 << 32
MAX_SHARD_BYTES = 1 << 40  # 1 TiB: shards are meant to be tens of MB
MAX_CLASSES = 10_000_000
# a plain file name: no separator, no "..", not hidden (temporary files start with ".")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
_CHUNK = 8 << 20


class ManifestError(PackError):
    """A manifest that cannot be trusted: the message names the manifest and the field."""


@dataclass(frozen=True)
class Shard:
    """One shard of a sharded pack, as its manifest describes it."""

    name: str
    count: int
    bytes: int
    xxh3_64: str
    #: the shard's metadata checksum (NOTE [ Shard fingerprints ]); None in older manifests
    metadata_xxh3_64: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The shard's entry in the manifest's text."""
        entry = {
            "name": self.name,
            "count": self.count,
            "bytes": self.bytes,
            "xxh3_64": self.xxh3_64,
        }
        if self.metadata_xxh3_64 is not None:
            entry["metadata_xxh3_64"] = self.metadata_xxh3_64
        return entry

    def fingerprint_problem(self, metadata: dict[str, Any]) -> str | None:
        """What is wrong with this shard, opened, when its checked ``metadata`` is not the one
        this entry names (NOTE [ Shard fingerprints ]); None when it is, or when the entry
        has no fingerprint (a manifest of the previous release)."""
        expected = self.metadata_xxh3_64
        if expected is None or metadata.get("checksum") == expected:
            return None
        return (
            f"its metadata checksum is {str(metadata.get('checksum'))[:20]}, the manifest's "
            f"metadata_xxh3_64 is {expected} (another pack's shard in its place, or the shard "
            "written again after the manifest)"
        )


@dataclass
class Manifest:
    """A checked manifest (see NOTE [ The shard manifest ])."""

    shards: list[Shard]
    backend: str
    store: str
    classes: list[str] = field(default_factory=list)
    schema: dict | None = None
    version: int = MANIFEST_VERSION
    created_by: str = "fastloader-pack"

    @property
    def count(self) -> int:
        """Samples in all shards."""
        return sum(shard.count for shard in self.shards)

    @property
    def size_bytes(self) -> int:
        """Bytes of all shards."""
        return sum(shard.bytes for shard in self.shards)

    def to_json(self) -> bytes:
        """The manifest's text (what ``parse_manifest`` reads back equal)."""
        value = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "backend": self.backend,
            "store": self.store,
            "count": self.count,
            "classes": list(self.classes),
            "schema": self.schema,
            "created_by": self.created_by,
            "shards": [shard.to_json() for shard in self.shards],
        }
        return dump_exact(value)


def file_checksum(path: str | Path) -> str:
    """The XXH3-64 digest of a file's bytes, as 16 hex digits."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and check a manifest's bytes; ``where`` names it in errors (a path or URL).

    Raises:
        ManifestError: naming ``where`` and the field, for anything not as written by
            ``fastloader-pack`` (see NOTE [ The shard manifest ]).
    """
    try:
        value = parse_json(raw, Path(where), "manifest")
    except ManifestError:
        raise
    except PackError as error:
        raise ManifestError(str(error)) from None
    return _checked(value, where)


def _fail(where: str, field_name: str, problem: str) -> ManifestError:
    return ManifestError(f"{where}: manifest field {field_name}: {problem}")


def _int(value: Any, where: str, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, name, f"must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise _fail(where, name, f"{value} is outside [{low}, {high}]")
    return value


def _checked(value: Any, where: str) -> Manifest:
    if not isinstance(value, dict):
        raise _fail(where, "(top)", "must be a JSON object")
    if value.get("format") != MANIFEST_FORMAT:
        raise _fail(where, "format", f"must be {MANIFEST_FORMAT!r}, got {value.get('format')!r}")
    version = _int(value.get("version"), where, "version", 1, 1 << 31)
    if version > MANIFEST_VERSION:
        raise _fail(
            where,
            "version",
            f"{version} is newer than this fastloader reads ({MANIFEST_VERSION}): upgrade it",
        )
    backend, store, classes, schema = _described(value, where)
    shards = _shards(value.get("shards"), where)
    total = sum(shard.count for shard in shards)
    if value.get("count") != total:
        raise _fail(where, "count", f"{value.get('count')!r} is not the shards' sum ({total})")
    created_by = value.get("created_by")
    return Manifest(
        shards,
        backend,
        store,
        classes,
        schema,
        version,
        created_by if isinstance(created_by, str) else "",
    )


def _described(value: dict, where: str) -> tuple[str, str, list[str], dict | None]:
    """The fields that describe the samples: backend, store, classes, schema."""
    backend = value.get("backend")
    if backend not in FORMATS:
        raise _fail(where, "backend", f"must be one of {', '.join(FORMATS)}, got {backend!r}")
    store = value.get("store")
    if not isinstance(store, str) or len(store) > 32:
        raise _fail(where, "store", "must be a short string")
    classes = value.get("classes")
    if not isinstance(classes, list) or len(classes) > MAX_CLASSES:
        raise _fail(where, "classes", f"must be a list of at most {MAX_CLASSES} names")
    if not all(isinstance(name, str) for name in classes):
        raise _fail(where, "classes", "must hold strings only")
    schema = value.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise _fail(where, "schema", "must be an object or null")
    return backend, store, classes, schema


def _shards(value: Any, where: str) -> list[Shard]:
    if not isinstance(value, list) or not value:
        raise _fail(where, "shards", "must be a non-empty list")
    if len(value) > MAX_SHARDS:
        raise _fail(where, "shards", f"{len(value)} shards, at most {MAX_SHARDS}")
    shards, seen = [], set()
    for number, item in enumerate(value):
        name = f"shards[{number}]"
        if not isinstance(item, dict):
            raise _fail(where, name, "must be an object")
        shard_name = item.get("name")
        if not isinstance(shard_name, str) or not _NAME.match(shard_name) or ".." in shard_name:
            raise _fail(
                where,
                f"{name}.name",
                f"{str(shard_name)[:80]!r} is not a plain file name (letters, digits, '._-'; "
                "no separator, no '..', not hidden)",
            )
        if shard_name in seen or shard_name == MANIFEST_NAME:
            raise _fail(where, f"{name}.name", f"{shard_name!r} appears twice")
        seen.add(shard_name)
        shards.append(
            Shard(
                shard_name,
                _int(item.get("count"), where, f"{name}.count", 1, MAX_SHARD_SAMPLES),
                _int(item.get("bytes"), where, f"{name}.bytes", 1, MAX_SHARD_BYTES),
                _digest(item, "xxh3_64", where, name, required=True),
                _digest(item, "metadata_xxh3_64", where, name, required=False),
            )
        )
    return shards


def _digest(item: dict, key: str, where: str, name: str, *, required: bool) -> Any:
    """``item[key]``, 16 lowercase hex digits; an optional one may be absent (None)."""
    if not required and key not in item:
        return None
    digest = item.get(key)
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise _fail(where, f"{name}.{key}", "must be 16 lowercase hex digits")
    return digest
