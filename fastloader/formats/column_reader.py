"""Reading a pack laid out by columns (format 5): rows of a field for a batch, or one sample.

Runs in whichever process reads; one ``ColumnTable`` per open handle (so per process). The
layout is NOTE [ Packs laid out by columns ] in column_layout.py.

NOTE [ Blocks checked once per process ]
Every byte of a field's data is covered by its block's checksum, and no row is used before
its block has been checked in this process. A table keeps one bit per block (all fields of
rows ``[b * rows_per_block, (b + 1) * rows_per_block)``); a batch's rows are looked up in it
(one NumPy index, about 2 us for 256 rows; nothing once every block is checked), and only
blocks not checked yet are hashed. The alternatives, measured on pose batches of 64 from an
LMDB pack (read and collated in one process, warm, load 4-7): hashing each row of each
fixed field on every read (a hash call per row and field) took 256 us a batch against 168 us
with the bitmap (0.66x the rate), and checking every block a batch touches on every read
about 10x as long (a block holds 16 rows: 16x the bytes). With the bitmap a pack reads at the
speed of a user's unchecked file once every block has been seen (the first epoch hashes the
pack once more than it reads it). A checked block stays checked while the process holds the
file: checksums guard against damage at rest and in copies; a pack replaced or re-packed is
refused when a process opens it again (NOTE [ Fork-safe readers ] in packfile.py), and bytes
rewritten in place under a running reader are not what they are for. A damaged block is a
PackError naming the file, the field and the rows, and its bit stays unset, so every read of
those rows raises again.

NOTE [ Text columns decoded once ]
A str or bytes field stored NUL-padded (file names) is what the default collate makes a list
of: one Python object per sample, which NumPy decodes 64 at a time in about 17 us a batch (a
gather, ``astype`` to unicode, ``tolist``). A pack's bytes never change under a reader (they
are checked, and a pack replaced is refused: NOTE [ Blocks checked once per process ]), so a
process decodes each block of such a column once, after its checksum, into an object array; a
batch is then one ``take`` of the objects it already holds (about 2 us for 64). The values are
the ones decoded from the bytes, exactly (a value that is not UTF-8 is kept as a marker and
raises as before, naming it, on every read). Only columns whose objects fit
``TEXT_CACHE_BYTES`` per process (about 200 000 names of 16 characters) are kept; a larger one
is decoded per batch. A user's file cannot do this: it may change under its reader
(NOTE [ A file changed under a reader ]). The objects are made in the process that reads (each
worker its own), so nothing is shared copy-on-write, and the cache grows only during the
first epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.column_layout import block_sum, head_size, part_name, row_bytes
from fastloader.formats.fields import IMAGE_RAW, FieldsDecoder
from fastloader.formats.mapped_rows import MappedRows
from fastloader.formats.metadata import check_array
from fastloader.formats.records import PackError

__all__ = ["ColumnTable", "checked_rows"]

#: Most bytes a process keeps of one text column's decoded values (NOTE [ Text columns
#: decoded once ]): each value's object (a ``str`` header of about 56 bytes and its text) and
#: its pointer.
TEXT_CACHE_BYTES = 16 << 20
_OBJECT_BYTES = 64
_UNDECODABLE = object()  # a cached value that is not UTF-8: read again, for its error
#: ``part(name, segment)``: a part's bytes as a uint8 array (a view of the file), or None.
PartReader = Callable[[str, int], "np.ndarray | None"]


def checked_rows(indices: Sequence[int] | np.ndarray, count: int, path: Path) -> np.ndarray:
    """``indices`` as int64 rows (negative from the end), each checked in range.

    Raises:
        IndexError: naming the file, for an index out of range.
        TypeError: for indices that are not integers.
    """
    if type(indices) is list and indices:  # the loader's batches: one conversion, one test
        rows = np.array(indices)
        # (negative rows seen as uint64 are past the end: they take the general path below)
        if rows.dtype == np.int64 and rows.ndim == 1 and rows.view(np.uint64).max() < count:
            return rows
    rows = np.asarray(indices)
    if rows.dtype.kind not in "iu" and len(rows):
        raise TypeError(f"indices must be integers, got {rows.dtype}")
    rows = rows.astype(np.int64, copy=False).reshape(-1)
    rows = np.where(rows < 0, rows + count, rows)
    if len(rows) and (rows.min() < 0 or rows.max() >= count):
        bad = np.asarray(indices).reshape(-1)[(rows < 0) | (rows >= count)][0]
        raise IndexError(f"index {bad} out of range for {count} samples in {path}")
    return rows


class _Column:
    """One field's parts, checked against the metadata."""

    def __init__(self, number: int, field: dict, column: dict) -> None:
        self.number = number
        self.field = field
        self.name = field["name"]
        self.fixed = column["storage"] == "fixed"
        self.column = column
        self.head = head_size(field)
        self.raw: list[np.ndarray] = []  # each segment's bytes
        self.rows: list[np.ndarray] = []  # fixed: each segment as (rows, *shape)
        self.width = 0  # bytes per row of a fixed field
        self.offsets: np.ndarray | None = None
        self.heads: np.ndarray | None = None
        self.sums = np.zeros(0, np.uint64)
        self.views: dict[int, memoryview] = {}  # of each segment, made on first use
        self.texts = self.fixed and field["kind"] in ("str", "bytes")  # NUL-padded
        self.cache: np.ndarray | None = None  # NOTE [ Text columns decoded once ]
        self.decoded = np.zeros(0, bool)  # per block: its values are in the cache
        self.undecoded = 0  # blocks not in the cache yet
        self.undecodable = False  # the cache holds a value that is not UTF-8
        if self.texts:
            self.unicode = np.dtype(("U", np.dtype(column["dtype"]).itemsize))

    def keep_texts(self, count: int, blocks: int) -> None:
        """Cache this text column's decoded values if they fit (NOTE [ Text columns decoded
        once ])."""
        if count * (_OBJECT_BYTES + self.unicode.itemsize // 4) <= TEXT_CACHE_BYTES:
            self.cache = np.empty(count, dtype=object)
            self.decoded = np.zeros(blocks, dtype=bool)
            self.undecoded = blocks


class ColumnTable:
    """The columns of one open pack, checked (see NOTE [ Blocks checked once per process ]).

    Args:
        path: the pack, for errors.
        metadata: its checked metadata (format 5).
        part: reads a part (``part_name(field, part)``, segment) from the open file.

    Raises:
        PackError: naming the file and the field, for a part missing, of the wrong size, or
            whose checksum (offsets, heads, block checksums) does not match the metadata.
    """

    def __init__(self, path: Path, metadata: dict, part: PartReader) -> None:
        self.path = path
        self.count = metadata["count"]
        layout = metadata["columns"]
        self.block = layout["rows_per_block"]
        self.segment = layout["rows_per_segment"]
        self.blocks = -(-self.count // self.block)
        self.segments = -(-self.count // self.segment)
        schema = metadata["schema"]
        self.structure = schema["structure"]
        self.decoders = FieldsDecoder(schema).decoders
        self.columns = [
            self._load(number, field, column, metadata, part)
            for number, (field, column) in enumerate(
                zip(schema["fields"], layout["fields"], strict=True)
            )
        ]
        self.names = [column.name for column in self.columns]
        for column in self.columns:
            if column.texts:
                column.keep_texts(self.count, self.blocks)
        self.verified = np.zeros(self.blocks, dtype=bool)
        self.unchecked = self.blocks  # blocks not checked yet

    def _part(self, part: PartReader, column: _Column, name: str, segment: int) -> np.ndarray:
        data = part(part_name(column.number, name), segment)
        if data is None:
            raise PackError(f"{self.path}: corrupt pack (field {column.name!r}: no {name})")
        return data

    def _small(self, part: PartReader, column: _Column, name: str, metadata: dict, nbytes: int):
        data = self._part(part, column, name, 0)
        if len(data) != nbytes:
            raise PackError(
                f"{self.path}: corrupt pack (field {column.name!r}: {name} of {len(data)} bytes, "
                f"expected {nbytes})"
            )
        check_array(data, part_name(column.number, name), metadata, self.path)
        return np.array(data)  # a checked copy: never read again from the file

    def _load(
        self, number: int, field: dict, spec: dict, metadata: dict, part: PartReader
    ) -> _Column:
        column = _Column(number, field, spec)
        sums = self._small(part, column, "sums", metadata, 8 * self.blocks)
        column.sums = sums.view("<u8")
        if column.fixed:
            width = column.width = row_bytes(spec)
            dtype = np.dtype(spec["dtype"])
            bounds = [width * min(self.segment, self.count - start) for start in self._starts()]
        else:
            offsets = self._small(part, column, "offsets", metadata, 8 * (self.count + 1))
            column.offsets = offsets.view("<i8").astype(np.int64)
            ends = column.offsets
            if ends[0] != 0 or np.any(np.diff(ends) < 0):
                raise PackError(f"{self.path}: corrupt pack (field {column.name!r}: offsets)")
            if column.head:
                heads = self._small(part, column, "heads", metadata, column.head * self.count)
                column.heads = heads.reshape(self.count, column.head)
            starts = list(self._starts())
            bounds = [
                int(ends[min(start + self.segment, self.count)] - ends[start]) for start in starts
            ]
        for segment, nbytes in enumerate(bounds):
            data = self._part(part, column, "data", segment)
            if len(data) != nbytes:
                raise PackError(
                    f"{self.path}: corrupt pack (field {column.name!r}: data segment {segment} "
                    f"of {len(data)} bytes, expected {nbytes})"
                )
            column.raw.append(data)
            if column.fixed:
                rows = nbytes // width if width else min(self.segment, self.count - segment)
                shape = (rows, *spec["shape"])
                column.rows.append(
                    np.ndarray(shape, dtype, buffer=data) if nbytes else np.zeros(shape, dtype)
                )
        return column

    def _starts(self) -> range:
        return range(0, self.count, self.segment)

    # --- checking ---------------------------------------------------------------------------
    def check_rows(self, rows: np.ndarray) -> None:
        """Check the blocks of ``rows`` not checked yet in this process.

        Raises:
            PackError: naming the file, the field and the rows of a damaged block.
        """
        if not self.unchecked:  # every block checked in this process: nothing to look up
            return
        blocks = rows // self.block
        todo = ~self.verified[blocks]
        if todo.any():
            for block in np.unique(blocks[todo]).tolist():
                self.check_block(block)

    def check_block(self, block: int) -> None:
        """Hash every field's bytes of ``block``; mark it checked if all match."""
        start = block * self.block
        stop = min(start + self.block, self.count)
        for column in self.columns:
            data = self._block_bytes(column, start, stop)
            actual = block_sum(data, column.number, block)
            stored = int(column.sums[block])
            if actual != stored:
                raise PackError(
                    f"{self.path}: damaged field {column.name!r} rows {start}-{stop - 1} "
                    f"(checksum mismatch: stored {stored:016x}, computed {actual:016x})"
                )
        if not self.verified[block]:
            self.verified[block] = True
            self.unchecked -= 1

    def _block_bytes(self, column: _Column, start: int, stop: int) -> np.ndarray:
        segment = start // self.segment
        data = column.raw[segment]
        first = segment * self.segment
        if column.fixed:
            width = column.width
            return data[(start - first) * width : (stop - first) * width]
        ends, base = column.offsets, column.offsets[first]
        return data[ends[start] - base : ends[stop] - base]

    # --- reading ----------------------------------------------------------------------------
    def batch(self, number: int, rows: np.ndarray) -> Any:
        """Field ``number``'s values of ``rows`` (checked), for a batch: ``MappedRows`` (one
        segment) or an array for a fixed field, a list of values for a ragged one."""
        column = self.columns[number]
        if not column.fixed:
            if column.field["kind"] in ("str", "bytes"):
                return self._texts(column, rows)
            return [self.value(number, row, _no_image) for row in rows.tolist()]
        if column.texts:
            return self._fixed_texts(column, rows)
        if self.segments == 1:  # every row in one segment: HDF5, and most LMDB packs
            source = column.rows[0]
            if source.dtype.isnative:
                return MappedRows(source, rows)
            return source[rows].astype(source.dtype.newbyteorder("="))
        segments = rows // self.segment
        first = int(segments[0])
        if (segments == first).all():
            source = column.rows[first]
            local = rows - first * self.segment
            if source.dtype.isnative:
                return MappedRows(source, local)
            return source[local].astype(source.dtype.newbyteorder("="))
        out = np.empty(
            (len(rows), *column.rows[0].shape[1:]), column.rows[0].dtype.newbyteorder("=")
        )
        for segment in np.unique(segments).tolist():
            at = segments == segment
            out[at] = column.rows[segment][rows[at] - segment * self.segment]
        return out

    def _fixed_texts(self, column: _Column, rows: np.ndarray) -> list:
        """A str or bytes field stored NUL-padded: the values of ``rows`` (checked)."""
        if column.cache is None:
            return self._decoded_texts(column, self._gather_texts(column, rows), rows)
        if column.undecoded:
            self._decode_blocks(column, rows)
        values = column.cache[rows].tolist()
        if column.undecodable and _UNDECODABLE in values:  # its error, naming the value
            return [self.value(column.number, row, _no_image) for row in rows.tolist()]
        return values

    def _decode_blocks(self, column: _Column, rows: np.ndarray) -> None:
        """Decode the blocks of ``rows`` not in ``column``'s cache yet, whole (their bytes
        checked already: NOTE [ Text columns decoded once ])."""
        blocks = rows // self.block
        for block in np.unique(blocks[~column.decoded[blocks]]).tolist():
            start = block * self.block
            stop = min(start + self.block, self.count)
            segment = start // self.segment
            local = start - segment * self.segment
            data = column.rows[segment][local : local + stop - start]
            values = self._decoded_texts(column, data, None)
            if _UNDECODABLE in values:
                column.undecodable = True
            column.cache[start:stop] = values
            column.decoded[block] = True
            column.undecoded -= 1

    def _gather_texts(self, column: _Column, rows: np.ndarray) -> np.ndarray:
        segments = rows // self.segment
        values = []
        for segment in np.unique(segments).tolist() if self.segments > 1 else [0]:
            at = rows if self.segments == 1 else rows[segments == segment]
            values.append(column.rows[segment][at - segment * self.segment])
        return values[0] if len(values) == 1 else self._in_order(values, segments)

    def _decoded_texts(self, column: _Column, gathered: np.ndarray, rows: Any) -> list:
        """NUL-padded values as the field's values: ``rows`` None marks a value that is not
        UTF-8 ``_UNDECODABLE``, else its error is raised (naming the row)."""
        if column.field["kind"] == "bytes":
            return gathered.tolist()
        try:  # ASCII, the usual file names: decoded by NumPy in one call
            return gathered.astype(column.unicode).tolist()
        except UnicodeDecodeError:
            pass
        try:
            return [text.decode("utf-8", "surrogatepass") for text in gathered.tolist()]
        except UnicodeDecodeError:
            if rows is None:
                return [_utf8_or_marker(text) for text in gathered.tolist()]
            return [self.value(column.number, row, _no_image) for row in rows.tolist()]

    @staticmethod
    def _in_order(values: list[np.ndarray], segments: np.ndarray) -> np.ndarray:
        out = np.empty(len(segments), values[0].dtype)
        for segment, chunk in zip(np.unique(segments).tolist(), values, strict=True):
            out[segments == segment] = chunk
        return out

    def _texts(self, column: _Column, rows: np.ndarray) -> list:
        """A str or bytes field's values of ``rows``: slices of the segment's bytes, decoded
        as a record's field is (one object per value: what the collate makes a list of)."""
        segments = rows // self.segment
        first = int(segments[0])
        if not (segments == first).all():
            return [self.value(column.number, row, _no_image) for row in rows.tolist()]
        view = column.views.get(first)
        if view is None:
            view = column.views[first] = memoryview(column.raw[first])
        base = column.offsets[first * self.segment]
        starts = (column.offsets[rows] - base).tolist()
        ends = (column.offsets[rows + 1] - base).tolist()
        if column.field["kind"] == "bytes":
            return [bytes(view[a:b]) for a, b in zip(starts, ends, strict=True)]
        try:
            return [
                str(view[a:b], "utf-8", "surrogatepass") for a, b in zip(starts, ends, strict=True)
            ]
        except UnicodeDecodeError:  # the error of the value that fails, naming it
            return [self.value(column.number, row, _no_image) for row in rows.tolist()]

    def value(self, number: int, row: int, image: Callable) -> Any:
        """Field ``number`` of row ``row`` (checked), as a read of a FIELDS record gives it;
        ``image(kind, shape, data, name)`` makes an image field's value (and must copy)."""
        column = self.columns[number]
        segment = row // self.segment
        local = row - segment * self.segment
        where = f"{self.path} row {row}"
        if column.fixed:
            value = column.rows[segment][local]
            kind = column.field["kind"]
            if kind == "image":
                return image(
                    IMAGE_RAW, tuple(column.column["shape"]), memoryview(value), column.name
                )
            if kind == "str":
                return self.decoders[number](memoryview(value.item()), where, image)
            if kind != "array":
                return value.item()
            return value.astype(value.dtype.newbyteorder("="))  # a copy, as a record's read
        ends, base = column.offsets, column.offsets[segment * self.segment]
        body = column.raw[segment][ends[row] - base : ends[row + 1] - base]
        if column.head:
            body = column.heads[row].tobytes() + body.tobytes()
        return self.decoders[number](memoryview(body), where, image)

    def sample(self, row: int, image: Callable) -> Any:
        """Row ``row`` as the sample that was packed (the schema's structure)."""
        values = [self.value(number, row, image) for number in range(len(self.columns))]
        if self.structure == "dict":
            return dict(zip(self.names, values, strict=True))
        return tuple(values) if self.structure == "tuple" else values

    def verify(self) -> list[tuple[int, str]]:
        """Check every block and decode every ragged value: ``(first row, reason)`` of each
        block that fails."""
        bad = []
        for block in range(self.blocks):
            try:
                self.check_block(block)
                start = block * self.block
                for row in range(start, min(start + self.block, self.count)):
                    for number, column in enumerate(self.columns):
                        if not column.fixed:
                            self.value(number, row, _image_header_only)
            except PackError as error:
                text = " ".join(str(error).split()).removeprefix(f"{self.path}: ")
                bad.append((block * self.block, text))
        return bad


def _utf8_or_marker(text: bytes) -> Any:
    try:
        return text.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return _UNDECODABLE


def _no_image(stored: int, shape: Any, data: memoryview, name: str) -> Any:
    raise PackError(f"field {name!r}: an image needs the dataset's decode (not a batch read)")


def _image_header_only(stored: int, shape: Any, data: memoryview, name: str) -> None:
    """An image field, its header already checked by the decoder; its bytes are covered by
    the block's checksum."""
