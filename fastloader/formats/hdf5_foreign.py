"""Users' own HDF5 files, read in place: aligned datasets as the fields of each sample.

``HDF5File(path)`` reads a file that fastloader did not write: every top-level dataset (or each
one named in ``fields``, groups addressed by path such as ``"labels/boxes"``) whose first
dimension is the sample count is a field, and ``file[i]`` is ``{name: row i}``. Torch-free; the
torch dataset is ``fastloader.datasets.users_files.HDF5FileDataset``.

NOTE [ Foreign HDF5 files ]
A user's file is the user's own data: it carries no checksum, so a flipped bit in it reads as
a flipped bit. What still holds is the rest of the trust line of packs (NOTE [ Only the HDF5
layout we write ] in hdf5.py): a damaged or hostile file raises a clear error and never
crashes, reads outside the file or allocates more than its size justifies.
- Every field is checked when the dataset is created, not at sample 10 000: its first
  dimension, its dtype (numbers, bools, fixed or variable-length strings; other object and
  variable-length types are refused, naming the dataset), that it is not 0-d.
- Storage that lies elsewhere (external links, external raw storage, virtual datasets) is
  refused unless ``allow_external=True``: it reads files other than the one named. Links are
  resolved to the file that holds the dataset before any offset is used: a soft link that
  leads through an external link is another file's dataset (refused, or read by h5py), never
  this file's bytes at that file's offset.
- A top-level object that cannot be opened (a damaged object header, a dangling link) is an
  error naming it, not a field silently left out.
- A contiguous, unfiltered dataset (what ``create_dataset`` writes without ``chunks``,
  ``compression`` or ``maxshape``) whose stored type is exactly what h5py reads it as (NOTE
  [ Mapped bytes are h5py's bytes ]) is read through our own read-only map of the byte range
  HDF5 reports for it, checked to lie inside the file: a row is a slice of memory, no HDF5
  call (NOTE [ Mapped rows ]). Everything else (chunked, compressed, strings of variable
  length) is read by h5py, whose filters bound what they inflate to the dataset's declared
  shape; a row that no compression of the file could hold (more than deflate's 1032:1) is
  refused at construction, so a hostile shape cannot make a read allocate terabytes.
- Every chunk is checked against the dataset's layout before h5py reads it (NOTE [ Chunks
  checked before h5py reads them ] in hdf5_chunks.py), every heap ID of a contiguous string
  dataset against its heap (NOTE [ Global heap checked before h5py ] in hdf5_heap.py).
- String datasets give a str per row; rows of several strings (``(N, 2)``) a list of str;
  bytes h5py's ``asstr()`` would not decode are a PackError naming the sample (NOTE [ Strings
  decoded as h5py decodes them ] in hdf5_text.py).

NOTE [ A file changed under a reader ]
A file rewritten or truncated while a loader reads it would give rows of another file (h5py's
cached structure over new bytes), or, through the map, a SIGBUS that kills the process at the
first page past the new end. So before every batch (``read_many``) the file's identity, its
device, inode, size and modification time, is compared with the one checked at construction
(one ``stat``, about a microsecond); a change is a PackError naming the file. What remains is
the window between that ``stat`` and the batch's copy (microseconds): a truncation inside it
is not caught, and a user who rewrites a file while training reads it is told at the next
batch.

NOTE [ Mapped rows ]
h5py pays 10-30 us of Python and HDF5 bookkeeping per ``dataset[i]`` (selection, type
conversion, the library lock), whatever the row's size: a pose sample of four fields costs
~100 us before a byte is copied. Our map turns a row into one NumPy slice copy, and a batch
into one fancy-indexed gather per field (``read_many``); chunked fields fall back to one sorted
h5py read per field per batch, which HDF5 serves chunk by chunk.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from fastloader.formats.hdf5_chunks import ChunkLayout, chunk_layout, index_problem
from fastloader.formats.hdf5_handle import FileHandle, items, short_error
from fastloader.formats.hdf5_heap import HEAP_ID_SIZE
from fastloader.formats.hdf5_text import TEXT_CODEC, TextError, decode_column
from fastloader.formats.mapped_rows import MappedRows
from fastloader.formats.packfile import ForkSafeFile, check_file, file_identity, sample_row
from fastloader.formats.records import PackError

__all__ = ["HDF5File"]

_MAX_INFLATION = 1032  # deflate's largest ratio: a row larger than that is not in the file

#: the element types of a batch of plain Python ints (bool, a subclass, is not one)
_INTS_ONLY = {int}


class _Field(NamedTuple):
    name: str  # its path in the file, the key of the sample dict
    kind: str  # "array" (a row is an ndarray), "scalar" (Python number) or "str"
    dtype: np.dtype  # as stored (strings: None)
    row_shape: tuple[int, ...]
    offset: int | None  # where its bytes start in the file, when mapped; None: read by h5py
    heap_ids: int | None = None  # variable-length strings: where their heap IDs start
    chunks: ChunkLayout | None = None  # filtered chunks: their output checked before h5py reads
    encoding: str = "utf-8"  # strings: their declared codec, as h5py's asstr() decodes them


class HDF5File(ForkSafeFile):
    """A user's HDF5 file of aligned datasets, one sample per row (torch-free reader).

    Args:
        path: the HDF5 file.
        fields: the datasets to read, by path (``"image"``, ``"labels/boxes"``); default every
            top-level dataset.
        allow_external: read datasets whose bytes lie in other files (external links, external
            storage, virtual datasets); refused by default (NOTE [ Foreign HDF5 files ]).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: naming the file (and the dataset) if it is not a readable HDF5 file, a field
            is missing, 0-d, of a type that cannot be read as NumPy or str, stored in another
            file (without ``allow_external``), or its first dimension differs from the others.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fields: Sequence[str] | None = None,
        *,
        allow_external: bool = False,
    ) -> None:
        self.path = Path(path)
        check_file(self.path)
        if isinstance(fields, str):
            fields = [fields]
        self.allow_external = allow_external
        self._identity = file_identity(self.path)
        self._handle: FileHandle | None = None
        self._pid: int | None = None
        handle = FileHandle(self.path, self._identity[2])
        try:
            self.fields, self._count = self._check_fields(handle, fields)
        except PackError:
            raise
        except Exception as error:  # noqa: BLE001 - h5py on a damaged file: anything
            raise PackError(f"{self.path}: damaged HDF5 file ({short_error(error)})") from None
        finally:
            handle.close()
        self.field_names = [field.name for field in self.fields]

    # --- construction: every field checked ------------------------------------------------
    def _check_fields(
        self, handle: FileHandle, fields: Sequence[str] | None
    ) -> tuple[list[_Field], int]:
        file = handle.file
        if fields is None:
            names = [name for name in file.keys() if self._is_dataset(file, name)]
            if not names:
                raise PackError(f"{self.path}: no top-level dataset to read (name fields=)")
        else:
            names = [str(name).strip("/") for name in fields]
            if len(set(names)) != len(names) or not names:
                raise ValueError(f"fields must name distinct datasets, got {list(fields)}")
        checked = [self._check_field(handle, name) for name in names]
        self._check_no_overlap(checked)
        lengths = {field.name: length for field, length in checked}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{name} has {length}" for name, length in lengths.items())
            raise PackError(
                f"{self.path}: the datasets are not aligned (first dimensions differ: {listed}); "
                f"name the aligned ones with fields="
            )
        return [field for field, _ in checked], next(iter(lengths.values()))

    def _check_no_overlap(self, checked: list[tuple[_Field, int]]) -> None:
        """Mapped datasets whose byte ranges overlap (a damaged data address that lands in
        another dataset) are refused, naming both; two names of one dataset share its range."""
        spans = sorted(
            (field.offset, field.offset + length * items(field.row_shape) * field.dtype.itemsize)
            + (field.name,)
            for field, length in checked
            if field.offset is not None
        )
        reach = (-1, -1, "")  # the span reaching furthest so far
        for start, end, name in spans:
            if start < reach[1] and (start, end) != reach[:2]:
                raise PackError(
                    f"{self.path}: datasets {reach[2]!r} and {name!r} claim overlapping bytes "
                    f"({reach[0]}-{reach[1]} and {start}-{end}): a damaged data address"
                )
            if end > reach[1]:
                reach = (start, end, name)

    def _is_dataset(self, file: h5py.File, name: str) -> bool:
        """Whether top-level ``name`` is a field by default: a dataset, or a link to one.

        An object that cannot be opened (a damaged header, a dangling link) is an error naming
        it, never a field silently left out (NOTE [ Foreign HDF5 files ])."""
        link = file.get(name, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            return True  # refused with its name by _check_field
        return isinstance(self._object(file, name), h5py.Dataset)

    def _object(self, file: h5py.File, name: str) -> h5py.Dataset | h5py.Group:
        try:
            return file[name]
        except Exception as error:  # noqa: BLE001 - h5py on a damaged file: anything
            if name not in file:  # no link of that name: a missing field
                raise PackError(
                    f"{self.path}: dataset {name!r}: no such dataset (the file has "
                    f"{sorted(file.keys())})"
                ) from None
            raise PackError(
                f"{self.path}: dataset {name!r} cannot be opened: a damaged object or a link "
                f"that leads nowhere ({short_error(error)}); name the other fields with fields="
            ) from None

    def _check_field(self, handle: FileHandle, name: str) -> tuple[_Field, int]:
        """A field's description and length, its first row read if h5py will read it: a
        damaged data address or filter is an error now, naming it, not at some batch."""
        try:
            field, length = self._describe_field(handle, name)
        except PackError:
            raise
        except Exception as error:  # noqa: BLE001 - h5py on a damaged file: anything
            raise PackError(
                f"{self.path}: dataset {name!r} is damaged ({short_error(error)})"
            ) from None
        if field.offset is None and length:
            first = np.zeros(1, dtype=np.int64)
            handle.check_heap(field, first, length)
            handle.check_chunks(field, first, length)
            try:
                handle.file[name][0:1]
            except Exception as error:  # noqa: BLE001 - h5py on a damaged file: anything
                raise PackError(
                    f"{self.path}: dataset {name!r} cannot be read (damaged: {short_error(error)})"
                ) from None
        return field, length

    def _describe_field(self, handle: FileHandle, name: str) -> tuple[_Field, int]:
        """A field's description and length: where it lies, what it holds, how it is read."""
        where = f"{self.path}: dataset {name!r}"
        dataset, linked = self._open_dataset(handle.file, name, where)
        external, mapped = self._storage(dataset, linked, where)
        if h5py.check_string_dtype(dataset.dtype) is not None:
            field = self._string_field(dataset, name, where, external, mapped)
        else:
            field = self._number_field(dataset, name, where, mapped)
        layout = chunk_layout(dataset) if field.offset is None and not external else None
        if layout is not None:  # NOTE [ Chunks checked before h5py reads them ]
            problem = index_problem(dataset.id, layout, dataset.shape[0], self._identity[2])
            if problem is not None:
                raise PackError(f"{where} is damaged: {problem}")
            field = field._replace(chunks=layout if layout.filters else None)
        return field, dataset.shape[0]

    def _open_dataset(self, file: h5py.File, name: str, where: str) -> tuple[h5py.Dataset, bool]:
        """The dataset ``name``, and whether links lead to it from another file; refused if
        they do (without ``allow_external``), if it is a group or 0-d."""
        linked = self._through_external_link(file, name)
        if linked and not self.allow_external:
            raise PackError(
                f"{where} is an external link to another file: refused "
                f"(pass allow_external=True to read it)"
            )
        dataset = self._object(file, name)
        if not isinstance(dataset, h5py.Dataset):
            raise PackError(f"{where} is a group, not a dataset (name its datasets as 'a/b')")
        if not _in_file(dataset, file):
            linked = True  # reached through links that lead to another file
            if not self.allow_external:
                raise PackError(
                    f"{where} lies in another file (a soft link through an external link): "
                    f"refused (pass allow_external=True to read it)"
                )
        if dataset.shape is None or len(dataset.shape) == 0:
            raise PackError(f"{where} is 0-d (a single value), not one row per sample")
        return dataset, linked

    def _storage(self, dataset: h5py.Dataset, linked: bool, where: str) -> tuple[bool, bool]:
        """Whether ``dataset``'s bytes lie in other files (refused without ``allow_external``),
        and whether they are mapped: contiguous, unfiltered, of exactly h5py's type."""
        plist = dataset.id.get_create_plist()
        layout = plist.get_layout()
        external = linked or layout == h5py.h5d.VIRTUAL or plist.get_external_count() > 0
        if external and not self.allow_external:
            raise PackError(
                f"{where} stores its data in other files (external or virtual storage): "
                f"refused (pass allow_external=True to read it)"
            )
        plain = not external and layout == h5py.h5d.CONTIGUOUS and not plist.get_nfilters()
        return external, plain and _maps_exactly(dataset)  # NOTE [ Mapped bytes are h5py's ...

    def _string_field(
        self, dataset: h5py.Dataset, name: str, where: str, external: bool, mapped: bool
    ) -> _Field:
        """Fixed-length strings may be mapped, variable-length ones never; both decoded as
        h5py's ``asstr()`` decodes them (NOTE [ Strings decoded as h5py decodes them ])."""
        shape, dtype = dataset.shape, dataset.dtype
        encoding = h5py.check_string_dtype(dtype).encoding
        if dtype.kind != "S":  # NOTE [ Global heap checked before h5py ]
            contiguous = dataset.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
            heap = self._heap_ids(dataset, where) if contiguous and not external else None
            return _Field(name, "str", dtype, tuple(shape[1:]), None, heap, encoding=encoding)
        offset = self._checked_offset(dataset, where) if mapped else None
        return _Field(name, "str", dtype, tuple(shape[1:]), offset, encoding=encoding)

    def _number_field(self, dataset: h5py.Dataset, name: str, where: str, mapped: bool) -> _Field:
        """Numbers, bools and records of them; other types refused, naming the dataset."""
        shape, dtype = dataset.shape, dataset.dtype
        if dtype.hasobject or h5py.check_vlen_dtype(dtype) is not None:
            raise PackError(
                f"{where} holds {dtype} values (variable-length or object), which cannot be "
                f"read as NumPy arrays"
            )
        if dtype.kind not in "biufc" and not (dtype.kind == "V" and dtype.fields):
            raise PackError(f"{where} holds {dtype} values, which fastloader does not read")
        row_bytes = items(shape[1:]) * dtype.itemsize
        if row_bytes > _MAX_INFLATION * self._identity[2] + (1 << 20):
            raise PackError(
                f"{where} declares rows of {row_bytes} bytes in a file of {self._identity[2]} "
                f"bytes: more than any compression of it could hold (damaged or hostile)"
            )
        kind = "scalar" if len(shape) == 1 and dtype.fields is None else "array"
        offset = self._checked_offset(dataset, where) if mapped else None
        return _Field(name, kind, dtype, tuple(shape[1:]), offset)

    def _through_external_link(self, file: h5py.File, name: str) -> bool:
        parts = name.split("/")
        for depth in range(1, len(parts) + 1):
            link = file.get("/".join(parts[:depth]), getlink=True)
            if isinstance(link, h5py.ExternalLink):
                return True
        return False

    def _heap_ids(self, dataset: h5py.Dataset, where: str) -> int | None:
        """Where a contiguous variable-length dataset's heap IDs start, checked to lie in the
        file; None if unwritten or of IDs other than 16 bytes (a file of 4-byte addresses),
        unchecked (NOTE [ Global heap checked before h5py ])."""
        offset, count = dataset.id.get_offset(), items(dataset.shape)
        if offset is None or dataset.file.id.get_create_plist().get_sizes()[0] != 8:
            return None
        stored, size = dataset.id.get_storage_size(), self._identity[2]
        if stored != count * HEAP_ID_SIZE or offset + count * HEAP_ID_SIZE > size:
            raise PackError(
                f"{where}: truncated or damaged file ({stored} bytes of heap IDs at offset "
                f"{offset} for {count} strings of {HEAP_ID_SIZE}; the file has {size})"
            )
        return offset

    def _checked_offset(self, dataset: h5py.Dataset, where: str) -> int | None:
        """Where a contiguous dataset's bytes start, checked to lie inside the file."""
        nbytes = int(np.prod(dataset.shape, dtype=np.int64)) * dataset.dtype.itemsize
        offset = dataset.id.get_offset()
        if offset is None or nbytes == 0:
            return None  # never written (reads as fill values) or empty: h5py reads it
        size = self._identity[2]
        if dataset.id.get_storage_size() != nbytes or offset + nbytes > size:
            raise PackError(
                f"{where}: truncated or damaged file ({nbytes} bytes declared at offset "
                f"{offset}; the file has {size})"
            )
        return offset

    # --- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.read_many([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return self.read_many(indices)

    def read_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples ``indices``, in order: one read per field for the whole batch. Raises
        IndexError for an index out of range; PackError if the file changed since the dataset
        was created, or HDF5 fails."""
        columns = self.read_columns(indices)
        return [
            {name: values[at] for name, values in columns.items()} for at in range(len(indices))
        ]

    def read_columns(self, indices: Sequence[int], later: bool = False) -> dict[str, Any]:
        """``read_many`` by field: an array of the rows (native byte order) per array field,
        a list of the values per number or string field; with ``later``, ``MappedRows`` for
        mapped native fields, gathered by the caller. Raises as ``read_many``."""
        rows = self._rows(indices)
        handle = self._handle_here()
        self._check_unchanged()  # every batch: NOTE [ A file changed under a reader ]
        columns = {}
        for field in self.fields:
            try:
                columns[field.name] = self._column(handle, field, rows, later)
            except PackError:
                raise
            except Exception as error:  # noqa: BLE001 - h5py on a damaged file: anything
                raise PackError(
                    f"{self.path}: reading dataset {field.name!r} failed ({short_error(error)})"
                ) from None
        return columns

    def _column(self, handle: FileHandle, field: _Field, rows: np.ndarray, later: bool) -> Any:
        if field.offset is not None:
            mapped = handle.mapped.get(field.name)
            if mapped is None:  # made once per open file
                mapped = handle.mapped[field.name] = np.frombuffer(
                    handle.map, field.dtype, self._count * items(field.row_shape), field.offset
                ).reshape((self._count, *field.row_shape))
            if (
                later
                and field.kind == "array"
                and mapped.dtype.isnative
                and not mapped.dtype.fields
            ):
                return MappedRows(mapped, rows)
            values = mapped[rows]  # one gather, a copy: NOTE [ Mapped rows ]
        else:
            handle.check_heap(field, rows, self._count)
            handle.check_chunks(field, rows, self._count)
            values = self._read_sorted(handle.dataset(field.name), rows)
        if field.kind == "str":  # a str per row; a nested list of str for (N, k, ...) rows
            return self._texts(field, values, rows)
        if not values.dtype.isnative and values.dtype.fields is None:  # torch wants native
            values = values.astype(values.dtype.newbyteorder("="))
        if field.kind == "scalar":
            return values.tolist()
        return values

    def _texts(self, field: _Field, values: np.ndarray, rows: np.ndarray) -> list:
        """String rows as str, or a PackError naming the sample whose bytes h5py's
        ``asstr()`` would not decode (NOTE [ Strings decoded as h5py decodes them ])."""
        try:
            return decode_column(values.tolist())
        except TextError as bad:
            raise PackError(
                f"{self.path}: dataset {field.name!r}, sample {int(rows[bad.at])}: not "
                f"{TEXT_CODEC} text (the dataset declares {field.encoding}; "
                f"{short_error(bad.error)}; h5py's asstr() raises UnicodeDecodeError too)"
            ) from None

    def _read_sorted(self, dataset: h5py.Dataset, rows: np.ndarray) -> np.ndarray:
        """``dataset[rows]`` in one h5py read: HDF5 wants increasing, distinct indices."""
        unique, inverse = np.unique(rows, return_inverse=True)
        if len(unique) == 1:
            values = dataset[int(unique[0]) : int(unique[0]) + 1]
        elif unique[-1] - unique[0] + 1 == len(unique):
            values = dataset[int(unique[0]) : int(unique[-1]) + 1]
        else:
            values = dataset[unique]
        return values[inverse]

    def _rows(self, indices: Sequence[int]) -> np.ndarray:
        count = self._count
        if type(indices) is list and indices and set(map(type, indices)) == _INTS_ONLY:
            rows = np.array(indices, dtype=np.int64)  # the loader's batches: one conversion
            low = rows.min()
            if low < 0:  # negative indices count from the end, as for a list
                rows[rows < 0] += count
                low = rows.min()
            if low >= 0 and rows.max() < count:
                return rows
        rows = [sample_row(index, count, self.path) for index in indices]
        return np.asarray(rows, dtype=np.int64)

    def _check_unchanged(self) -> None:
        # NOTE [ Fork-safe readers ] in packfile.py; NOTE [ A file changed under a reader ]
        try:
            identity = file_identity(self.path)
        except OSError:
            identity = None
        if identity != self._identity:
            raise PackError(
                f"{self.path}: the file changed since this dataset opened it (written, "
                f"truncated or replaced): create the dataset again"
            )

    def _open(self) -> FileHandle:
        return FileHandle(self.path, self._identity[2])

    def _close_handle(self, handle: FileHandle) -> None:
        handle.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self)} samples, {self.field_names})"


def _in_file(dataset: h5py.Dataset, file: h5py.File) -> bool:
    """Whether ``dataset`` lies in ``file`` itself, whatever links led to it."""
    return h5py.h5o.get_info(dataset.id).fileno == h5py.h5o.get_info(file.id).fileno


# NOTE [ Mapped bytes are h5py's bytes ]
# h5py converts a dataset's stored type to the NumPy dtype it reports: N-bit integers (a
# precision or bit offset other than the whole word) are shifted and masked, strings padded
# with spaces or terminated by a null are trimmed, floats of other layouts are converted. A
# mapped row skips that conversion, so a dataset is mapped only when its stored HDF5 type is
# exactly the type h5py reads it into (``H5Tequal`` with the memory type h5py makes for its
# dtype): byte order included (a big-endian dataset's bytes are mapped as big-endian and
# converted by NumPy, as h5py would). Anything else is read by h5py.
def _maps_exactly(dataset: h5py.Dataset) -> bool:
    try:
        return bool(dataset.id.get_type().equal(h5py.h5t.py_create(dataset.dtype)))
    except Exception:  # noqa: BLE001 - a type h5py cannot describe: it reads it, or refuses
        return False
