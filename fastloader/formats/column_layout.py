"""The column layout of a pack of fields (format 5): its description, checks and writer side.

NOTE [ Packs laid out by columns ]
A pack of any sample used to hold one FIELDS record per sample (format 4: NOTE [ Fields
payload ] in fields.py): a batch was decoded a sample at a time, 3-10x slower than reading the
user's own file by columns (issue 38). From format 5 a pack of fields is stored by field:

- a **fixed** field (an array whose shape is the same in every sample, a raw image of one
  size, an ``int``, ``float`` or ``bool``) is one array of the rows back to back, ``count`` x
  row shape, little-endian as the schema says: a batch of rows is one NumPy gather, straight
  into the batch (or the worker's shared-memory slot: ``MappedRows``), as for a user's file;
- a **ragged** field (arrays whose shape varies, encoded images, ``str``, ``bytes``, ``json``)
  is the values' bytes back to back (``data``), their ``offsets`` (int64, count + 1) and, for
  arrays and images, each value's ``heads`` (its dimensions, or its image header: the bytes
  that lead the value in a FIELDS payload), so that a value reads back through the same
  per-field decoder, with the same checks, as a record's field does.

Rows are grouped in blocks of ``rows_per_block`` (a power of two, about 256 KiB of the widest
field), and each field has one xxh3_64 checksum per block (``sums``), seeded with the field's
index and the block's, so a block read as another field's or another block's fails (NOTE
[ Checksums bound to positions ] in records.py). ``offsets``, ``heads`` and ``sums`` are small
and covered by the metadata's checksums (NOTE [ Metadata checksums ]); they are checked when a
process opens the pack. The data is checked a block at a time before any row of it is used
(NOTE [ Blocks checked once per process ] in column_reader.py).

In HDF5 each part is one contiguous 1-D dataset, ``col<i>.data``, ``col<i>.offsets``,
``col<i>.heads``, ``col<i>.sums``. In LMDB each part is a value under ``b"col" + >H field +
part letter + >I segment``; a field's data is cut into segments of ``rows_per_segment`` rows
(a multiple of the block, at most ``SEGMENT_BYTES``: LMDB keeps a write transaction's pages in
memory), each one value in contiguous overflow pages, so a batch whose rows lie in one segment
is one gather there too. Nothing per sample is stored beside the columns: no labels, no
record headers. A pack of 20 000 pose samples is the size of the file it was made from.
The metadata says ``"layout": "columns"`` and describes each column under ``"columns"``.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from fastloader.formats.records import HEADER_SIZE, PackError

__all__ = [
    "LAYOUTS",
    "PARTS",
    "ColumnSpool",
    "block_seed",
    "check_columns",
    "column_key",
    "column_key_count",
    "part_name",
]

#: The layouts of a pack of fields: one record per sample (format 4), or columns (format 5).
LAYOUTS = ("columns", "records")
PARTS = ("data", "offsets", "heads", "sums")
BLOCK_BYTES = 256 << 10
MAX_ROWS_PER_BLOCK = 1 << 16
SEGMENT_BYTES = 256 << 20
_SCALAR_DTYPES = {"int": "<i8", "float": "<f8", "bool": "|b1"}
_IMAGE_HEAD = 16
_TEXTS = ("str", "bytes")
MAX_TEXT_WIDTH = 1 << 12
_RAW = 1


def part_name(field: int, part: str) -> str:
    """The name of a column part: an HDF5 dataset's, and a metadata checksum's key."""
    return f"col{field}.{part}"


def column_key(name: str, segment: int) -> bytes:
    """The key of segment ``segment`` of column part ``name`` (``col<i>.<part>``)."""
    return b"col:" + name.encode() + b":" + struct.pack(">I", segment)


def column_key_count(metadata: dict) -> int:
    """How many LMDB keys (``column_key``) a pack laid out by columns has, counted from its
    metadata without making them (a damaged count must not make a list the file's size does
    not justify)."""
    layout = metadata["columns"]
    segments = -(-metadata["count"] // layout["rows_per_segment"])
    fields = metadata["schema"]["fields"]
    ragged = [
        field["kind"]
        for field, column in zip(fields, layout["fields"], strict=True)
        if column["storage"] == "ragged"
    ]
    heads = sum(kind in ("array", "image") for kind in ragged)
    return len(fields) * (segments + 1) + len(ragged) + heads


def block_seed(field: int, block: int) -> int:
    """The seed of block ``block`` of field ``field``'s checksum (fields < 2**16)."""
    return (block << 16) | field


def block_sum(data: Any, field: int, block: int) -> int:
    """The checksum of one block's bytes."""
    return xxhash.xxh3_64_intdigest(data, block_seed(field, block))


def head_size(field: dict) -> int:
    """Bytes that lead a value of ``field`` in a FIELDS payload (dimensions, image header)."""
    if field["kind"] == "array":
        return 8 * field["ndim"]
    return _IMAGE_HEAD if field["kind"] == "image" else 0


def row_bytes(column: dict) -> int:
    """Bytes of one row of a fixed column."""
    # Python ints: np.prod cost 20 us a call, paid per block when a pack's blocks are checked
    return math.prod(int(size) for size in column["shape"]) * np.dtype(column["dtype"]).itemsize


def check_columns(metadata: dict, path: Path | str) -> dict:
    """Check the ``columns`` description of a format-5 pack against its schema.

    Raises:
        PackError: naming the file and what is wrong.
    """
    where = f"{path}: corrupt metadata (columns"
    layout = metadata.get("columns")
    fields = metadata["schema"]["fields"]
    if not isinstance(layout, dict) or not isinstance(layout.get("fields"), list):
        raise PackError(f"{where} missing)")
    block, segment = layout.get("rows_per_block"), layout.get("rows_per_segment")
    for value in (block, segment):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PackError(f"{where}: bad rows per block or segment)")
    if block > MAX_ROWS_PER_BLOCK or block & (block - 1) or segment % block:
        raise PackError(f"{where}: bad rows per block or segment)")
    if len(layout["fields"]) != len(fields):
        raise PackError(f"{where}: {len(layout['fields'])} columns for {len(fields)} fields)")
    for field, column in zip(fields, layout["fields"], strict=True):
        _check_column(field, column, where)
    return layout


def _check_column(field: dict, column: Any, where: str) -> None:
    name = str(field["name"])[:60]
    if not isinstance(column, dict) or column.get("storage") not in ("fixed", "ragged"):
        raise PackError(f"{where}: field {name!r} has no known storage)")
    if column["storage"] == "ragged":
        if field["kind"] in _SCALAR_DTYPES:
            raise PackError(f"{where}: field {name!r} ragged)")
        return
    shape = column.get("shape")
    if not isinstance(shape, list) or not all(map(_is_length, shape)):
        raise PackError(f"{where}: field {name!r} has a bad shape)")
    kind = field["kind"]
    expected = _expected_fixed(field, column)
    if not expected or column.get("dtype") != expected[0] or len(shape) != expected[1]:
        raise PackError(f"{where}: field {name!r} cannot be fixed as {column.get('dtype')})")
    if kind == "image" and shape[2] not in (1, 3, 4):
        raise PackError(f"{where}: field {name!r} has a bad image shape)")
    if row_bytes(column) > 1 << 40:
        raise PackError(f"{where}: field {name!r} has rows too large)")


_TEXT_DTYPE = re.compile(r"\|S([1-9][0-9]{0,3})")
#: The (dtype, ndim) of a fixed column of each kind but ``array`` (the schema's).
_FIXED = {"image": ("|u1", 3), **{kind: (dtype, 0) for kind, dtype in _SCALAR_DTYPES.items()}}


def _expected_fixed(field: dict, column: dict) -> tuple:
    """The (dtype, ndim) a fixed column of ``field`` must have; () if it cannot be fixed."""
    if field["kind"] in _TEXTS:  # NUL-padded to one width: any |S<n>
        dtype = str(column.get("dtype"))
        return (dtype, 0) if _TEXT_DTYPE.fullmatch(dtype) else ()
    return _FIXED.get(field["kind"]) or (field.get("dtype"), field.get("ndim"))


def _is_length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40


class _FieldSpool:
    """One field's values as they are written: heads in memory, bodies in a temporary file."""

    def __init__(self, field: dict, folder: Path) -> None:
        self.field = field
        self.head = head_size(field)
        self.heads = bytearray()
        self.first_head: bytes | None = None
        self.same_heads = True
        self.ends = array("q", [0])
        self.same_lengths = True
        self.body = tempfile.TemporaryFile(dir=folder, prefix=".fastloader-column.")
        self.longest = 0  # bytes of the longest value
        self.nul_end = False  # a value ends with a NUL byte (cannot be padded with NULs)

    def add(self, value: memoryview) -> None:
        head, body = bytes(value[: self.head]), value[self.head :]
        if self.first_head is None:
            self.first_head = head
        elif head != self.first_head:
            self.same_heads = False
        if len(self.ends) > 1 and len(body) != self.ends[1]:
            self.same_lengths = False
        if len(body) > self.longest:
            self.longest = len(body)
        if body[-1:] == b"\0":
            self.nul_end = True
        self.heads += head
        self.body.write(body)
        self.ends.append(self.ends[-1] + len(body))

    def column(self) -> dict:
        """How the field is stored: fixed when every row has one shape (see the NOTE)."""
        kind, head = self.field["kind"], self.first_head or b""
        if kind in _SCALAR_DTYPES:
            return {"storage": "fixed", "dtype": _SCALAR_DTYPES[kind], "shape": []}
        if kind in _TEXTS and self._padded():
            return {"storage": "fixed", "dtype": f"|S{max(self.longest, 1)}", "shape": []}
        if not (self.same_heads and self.same_lengths):
            return {"storage": "ragged"}
        if kind == "array":
            shape = list(struct.unpack(f"<{self.field['ndim']}Q", head))
            return {"storage": "fixed", "dtype": self.field["dtype"], "shape": shape}
        if kind == "image" and head[0] == _RAW:
            height, width, channels = struct.unpack_from("<III", head, 4)
            return {"storage": "fixed", "dtype": "|u1", "shape": [height, width, channels]}
        return {"storage": "ragged"}

    def _padded(self) -> bool:
        """Whether str or bytes values are stored NUL-padded to the longest (NumPy's ``S``
        dtype: a batch is one gather, as a user's fixed-length strings): when no value ends
        with NUL and padding costs no more than offsets would."""
        count = len(self.ends) - 1
        fits = max(self.longest, 1) * count <= self.ends[-1] + 8 * count
        return fits and not self.nul_end and self.longest <= MAX_TEXT_WIDTH

    def stored(self, column: dict) -> tuple[np.ndarray, np.ndarray]:
        """The bytes of the column as stored, and each row's end in them."""
        ends = np.frombuffer(self.ends, np.int64)
        if not (column["storage"] == "fixed" and self.field["kind"] in _TEXTS):
            return self.data(), ends
        width = np.dtype(column["dtype"]).itemsize
        padded = np.zeros((len(ends) - 1, width), np.uint8)
        padded[np.arange(width) < np.diff(ends)[:, None]] = self.data()
        return padded.reshape(-1), np.arange(len(ends), dtype=np.int64) * width

    def data(self) -> np.ndarray:
        """The bodies back to back, mapped from the temporary file."""
        size = self.ends[-1]
        self.body.flush()
        if size == 0:
            return np.zeros(0, np.uint8)
        return np.frombuffer(mmap.mmap(self.body.fileno(), size, access=mmap.ACCESS_READ), np.uint8)

    def close(self) -> None:
        self.body.close()


class ColumnSpool:
    """A pack's FIELDS records taken apart into columns as they are appended (writer side).

    ``add(record)`` takes one sealed record of kind FIELDS (what the packing workers make);
    ``parts(segment_bytes)`` then yields every part to store, and ``layout`` describes them for
    the metadata. Bodies are spooled to temporary files beside the pack.
    """

    def __init__(self, schema: dict, folder: Path) -> None:
        self.schema = schema
        self.fields = [_FieldSpool(field, folder) for field in schema["fields"]]
        self.table = struct.Struct(f"<I{len(self.fields)}Q")
        self.count = 0
        self.layout: dict | None = None

    def add(self, record: bytes) -> None:
        payload = memoryview(record)[HEADER_SIZE:]
        _, *ends = self.table.unpack_from(payload)
        start = base = self.table.size
        for spool, end in zip(self.fields, ends, strict=True):
            spool.add(payload[start : base + end])
            start = base + end
        self.count += 1

    def parts(self, segment_bytes: int | None) -> Iterator[tuple[str, int, np.ndarray]]:
        """``(part name, segment, bytes)`` of every part; ``segment_bytes`` None: one segment
        per field (HDF5). Sets ``layout`` first."""
        columns = [spool.column() for spool in self.fields]
        stored = [spool.stored(column) for spool, column in zip(self.fields, columns, strict=True)]
        all_ends = [ends for _, ends in stored]
        block = _rows_per_block(all_ends, self.count)
        segment = _rows_per_segment(all_ends, block, self.count, segment_bytes)
        self.layout = {"rows_per_block": block, "rows_per_segment": segment, "fields": columns}
        for number, (spool, column) in enumerate(zip(self.fields, columns, strict=True)):
            data, ends = stored[number]
            yield from _data_segments(number, data, ends, segment, self.count)
            sums = [
                block_sum(data[ends[start] : ends[min(start + block, self.count)]], number, at)
                for at, start in enumerate(range(0, self.count, block))
            ]
            yield part_name(number, "sums"), 0, np.asarray(sums, "<u8").view(np.uint8)
            if column["storage"] == "ragged":
                yield part_name(number, "offsets"), 0, ends.astype("<i8").view(np.uint8)
                if spool.head:
                    yield part_name(number, "heads"), 0, np.frombuffer(spool.heads, np.uint8)
            del data
            stored[number] = None

    def close(self) -> None:
        for spool in self.fields:
            spool.close()


def _data_segments(
    number: int, data: np.ndarray, ends: np.ndarray, segment: int, count: int
) -> Iterator[tuple[str, int, np.ndarray]]:
    for at, start in enumerate(range(0, count, segment)):
        end = min(start + segment, count)
        yield part_name(number, "data"), at, data[ends[start] : ends[end]]


def _rows_per_block(ends: list[np.ndarray], count: int) -> int:
    widest = max(int(end[-1]) for end in ends) / max(count, 1)
    rows = 1
    while rows < MAX_ROWS_PER_BLOCK and rows * 2 * widest <= BLOCK_BYTES:
        rows *= 2
    return rows


def _rows_per_segment(ends: list[np.ndarray], block: int, count: int, limit: int | None) -> int:
    """Rows per data segment: a multiple of the block, whose bytes stay within ``limit`` in
    every field (a single block may exceed it); every row in one segment without a limit."""
    whole = -(-max(count, 1) // block) * block
    if limit is None:
        return whole
    rows = whole
    while rows > block:
        starts = np.arange(0, count, rows)
        stops = np.minimum(starts + rows, count)
        if all(int((end[stops] - end[starts]).max()) <= limit for end in ends):
            return rows
        rows = max(block, (rows // 2) // block * block)
    return block
