"""The record codec shared by every packed-file backend, with its checksum.

A record is a fixed 32-byte header followed by the payload::

    magic     2s   b"FL"
    kind      u8   0 = encoded image file bytes (JPEG, PNG, ...), 1 = raw uint8 HWC pixels
    chans     u8   channels of a raw record (0 for encoded)
    height    u32  rows of a raw record (0 for encoded)
    width     u32  columns of a raw record (0 for encoded)
    length    u32  payload length in bytes (detects truncation)
    label     i64  the class index
    checksum  u64  xxh3_64 of the payload, seeded with the xxh3_64 of the 24 bytes above,
                   itself seeded with the record's position in the pack (format 3)

NOTE [ Record checksums ]
Every byte that decides a sample (the payload, the header that says how to read it, and the
label) is covered by one 64-bit checksum, verified on every read by default. The hash is
xxHash's XXH3 (the ``xxhash`` package, a thin binding of the reference C library): it hashes at
memory speed (about 90 GB/s per core for a 200 KB raw record in cache here, 2.2 us), where
CRC32C in Python (``crc32c``/``google-crc32c``) runs at a few GB/s and zlib's CRC32 slower
still. Reads verify after the decode, while the bytes are in cache (NOTE [ Checksum after the
copy ] in packfile.py): about 3% of a raw read with a crop and resize, but ~20% of one that only
copies the pixels out, since the hash then reads as many bytes as the copy. A 64-bit hash also
makes an undetected random corruption practically impossible (2^-64), where a 32-bit CRC leaves
1 in 4 billion. The header and payload are hashed in place (two calls, the header's digest
seeding the payload's), so verifying copies nothing. The metadata, labels, offsets and source
paths have checksums of their own (see metadata.py).

NOTE [ Checksums bound to positions ]
A checksum over a record's own bytes cannot tell record 56 from record 5: damage to the
structure that says where record 56 lies (an LMDB overflow-page number, say) can point it at
another whole record, whose checksum is right, and the sample would be silently wrong. From
format version 3 the header's hash is seeded with the record's position, so a record read in
any other position fails its checksum. It costs nothing (XXH3 takes the seed as an argument).
Writers bind each record as they append it (``PackWriter.append`` re-seals the record that
``encode_record`` made, whose checksum is unbound: position 0's seed).

Format version 2 added the checksum, version 3 bound it to positions, version 4 added packs of
any sample (FIELDS records and a schema; packs of (image, label) are still written as 3),
version 5 lays packs of any sample out by columns (NOTE [ Packs laid out by columns ] in
column_layout.py: checksums per block of rows; version 4 is still written with
``layout="records"``).
Version-2 packs are still read, with unbound checksums (``--info`` says so; re-pack for the
binding); version-1
packs (no checksums) are refused with a message that says to re-pack them (see
metadata.load_metadata).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import xxhash

FORMAT_NAME = "fastloader-pack"
FORMAT_VERSION = 3  # what packs of (image, label) records are written as
FIELDS_VERSION = 4  # packs of any sample: FIELDS records and a schema (formats/fields.py)
COLUMNS_VERSION = 5  # packs of any sample laid out by columns (formats/column_layout.py)
NEWEST_VERSION = COLUMNS_VERSION  # the newest this version of fastloader reads
UNBOUND_VERSION = 2  # the last format whose record checksums are not bound to positions
STORE_MODES = ("encoded", "raw", "jpeg")

_HEADER = struct.Struct("<2sBBIIIqQ")
_SIGNED = 24  # the header bytes before the checksum
_STORED = struct.Struct("<Q")
HEADER_SIZE = _HEADER.size
_MAGIC = b"FL"
_hash = xxhash.xxh3_64_intdigest


class PackError(ValueError):
    """A packed file is missing, truncated, damaged, foreign, incomplete, or from another
    version of fastloader; the message names the file and what is wrong."""


class RecordKind(IntEnum):
    """What a record's payload holds."""

    ENCODED = 0
    RAW = 1
    FIELDS = 2  # every field of a sample (format 4: NOTE [ Fields payload ] in fields.py)


_KINDS = tuple(RecordKind)  # by value: an index is cheaper than RecordKind(value) per read


class Record(NamedTuple):
    """One decoded record header and a view of its payload (valid while the buffer lives)."""

    label: int
    kind: RecordKind
    shape: tuple[int, int, int] | None
    payload: memoryview


def checksum(header: bytes | memoryview, payload: bytes | memoryview, position: int = 0) -> int:
    """The checksum of a record at ``position`` (0: unbound): see NOTE [ Record checksums ]."""
    return _hash(payload, _hash(header, position))


def checksum_matches(buffer: bytes | memoryview, position: int = 0) -> bool:
    """Whether a whole record's bytes (at least ``HEADER_SIZE``) match its stored checksum as
    the record at ``position`` (NOTE [ Checksums bound to positions ]; 0 for format 2).

    The fast path of every checked read: hashed in place, no Python frame but this one.
    """
    view = buffer if type(buffer) is memoryview else memoryview(buffer)
    expected = _STORED.unpack_from(view, _SIGNED)[0]
    return _hash(view[HEADER_SIZE:], _hash(view[:_SIGNED], position)) == expected


def checksum_error(
    buffer: bytes | memoryview, where: str = "record", position: int = 0
) -> PackError | None:
    """The error of a record whose checksum does not match its bytes, else None.

    ``buffer`` is a whole record of at least ``HEADER_SIZE`` bytes, read as the record at
    ``position``; it is hashed in place.
    """
    view = memoryview(buffer)
    stored = _STORED.unpack_from(view, _SIGNED)[0]
    actual = checksum(view[:_SIGNED], view[HEADER_SIZE:], position)
    if actual == stored:
        return None
    return PackError(
        f"{where}: damaged record (checksum mismatch: stored {stored:016x}, computed {actual:016x})"
    )


def bind_record(record: bytes, position: int) -> bytes:
    """``record`` (from ``encode_record``: unbound) re-sealed as the record at ``position``.

    Raises:
        ValueError: if ``record`` is not a whole record whose unbound checksum matches.
    """
    if len(record) < HEADER_SIZE or not checksum_matches(record):
        raise ValueError("not a whole record from encode_record (its checksum does not match)")
    view = memoryview(record)
    sealed = _STORED.pack(checksum(view[:_SIGNED], view[HEADER_SIZE:], position))
    return bytes(view[:_SIGNED]) + sealed + bytes(view[HEADER_SIZE:])


def encode_record(
    payload: bytes | memoryview | np.ndarray,
    label: int,
    kind: RecordKind,
    shape: tuple[int, int, int] | None = None,
) -> bytes:
    """Return the bytes of one record, its checksum included.

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
    header = _HEADER.pack(_MAGIC, kind, channels, height, width, length, int(label), 0)
    signed = header[:_SIGNED]
    return signed + struct.pack("<Q", checksum(signed, payload)) + bytes(payload)


def decode_record(
    buffer: bytes | memoryview, where: str = "record", verify: bool = True, position: int = 0
) -> Record:
    """Parse one record without copying its payload, verifying its checksum.

    Args:
        buffer: the record's bytes.
        where: how errors name the record (file and index).
        verify: check the checksum (default); False skips only that check.
        position: the record's position, which its checksum is bound to (0: unbound, format 2).

    Raises:
        PackError: naming ``where`` if the record is truncated, damaged (checksum mismatch), or
            not a fastloader record.
    """
    view = memoryview(buffer)
    if len(view) < HEADER_SIZE:
        raise PackError(f"{where}: truncated record ({len(view)} bytes, header needs 32)")
    magic, kind, channels, height, width, length, label, stored = _HEADER.unpack_from(view)
    if verify:
        damaged = checksum_error(view, where, position)
        if damaged is not None:
            raise damaged
    if magic != _MAGIC or kind >= len(_KINDS):
        raise PackError(f"{where}: not a fastloader record (bad header)")
    if len(view) - HEADER_SIZE != length:
        raise PackError(
            f"{where}: truncated record (payload {len(view) - HEADER_SIZE} of {length} bytes)"
        )
    shape = (height, width, channels) if kind == RecordKind.RAW else None
    if shape is not None and (height * width * channels != length or channels not in (1, 3, 4)):
        raise PackError(f"{where}: corrupt record (shape {shape} does not match {length} bytes)")
    return Record(label, _KINDS[kind], shape, view[HEADER_SIZE:])
