"""HDF5 packs: every record back to back in one uint8 dataset, located by an offsets array.

Datasets, all contiguous, unfiltered, in the file itself: ``records`` (uint8), ``offsets``
(int64, count + 1), ``targets`` (int64 labels), with source paths ``sources`` (uint8, UTF-8
back to back) and ``source_offsets`` (int64, count + 1), and ``metadata`` (uint8, the JSON),
written last, so a file without it is an interrupted run (see metadata.load_metadata).

NOTE [ Contiguous HDF5 records ]
A random read of a chunked dataset goes through HDF5's chunk index and cache and copies whole
chunks; on a pack of a few hundred MB that halved read throughput. So ``records`` is one
contiguous block: the writer spools records to an anonymous temporary file and writes the block
once, at close, when its size is known. Readers then memory-map the block at the offset HDF5
reports and read records as zero-copy slices, as LMDB readers do.

NOTE [ Only the HDF5 layout we write ]
HDF5 can make a dataset's bytes come from anywhere: another file (external storage), other
datasets (virtual datasets), or a filter pipeline that inflates a few KB of gzip into GBs. A pack
from anyone must not read outside itself or allocate more than its size, so a reader accepts
only what the writer makes: the datasets above and nothing else, each a hard link, contiguous,
without filters or external files, of the exact dtype and shape, whose bytes lie inside the
file. Everything is then read through our own memory map of those byte ranges, never through
HDF5's read path.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fastloader.formats.column_layout import ColumnSpool, part_name
from fastloader.formats.metadata import check_array, check_targets, load_metadata
from fastloader.formats.pack_writer import PackWriter
from fastloader.formats.packfile import PackFile
from fastloader.formats.records import PackError
from fastloader.formats.signatures import HDF5_SIGNATURE, not_hdf5_hint

_COPY_BYTES = 64 << 20
_UINT8, _INT64 = np.dtype("uint8"), np.dtype("<i8")
_REQUIRED = {"records": _UINT8, "offsets": _INT64, "targets": _INT64, "metadata": _UINT8}
_SOURCES = {"sources": _UINT8, "source_offsets": _INT64}
#: Every top-level name a pack has: a file with any other is a user's own (``is_hdf5_pack``).
_PACK_NAMES = frozenset({**_REQUIRED, **_SOURCES})
#: The datasets of a pack laid out by columns (NOTE [ Packs laid out by columns ]), all uint8.
_COLUMN_NAME = re.compile(r"col(0|[1-9][0-9]{0,4})\.(data|offsets|heads|sums)")


def _pack_name(name: str) -> bool:
    return name in _PACK_NAMES or _COLUMN_NAME.fullmatch(str(name)) is not None


def is_hdf5_pack(path: str | os.PathLike) -> bool:
    """Whether ``path`` should be opened as a fastloader pack rather than a user's own file.

    True for a file that is not HDF5 at all, that h5py cannot open, or whose top-level names are
    all names a pack uses (an interrupted pack has none): the pack reader then says what is
    wrong. False for an HDF5 file with any other top-level name.
    """
    path = Path(path)
    try:
        with open(path, "rb") as file:
            if file.read(len(HDF5_SIGNATURE)) != HDF5_SIGNATURE:
                return True
        with h5py.File(path, "r") as file:
            names = set(file.keys())
    except Exception:  # noqa: BLE001 - the pack reader reports what is wrong with it
        return True
    return all(_pack_name(name) for name in names)


class _Handle:
    """An open pack: the HDF5 file and memory maps of its checked datasets."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = os.path.getsize(path)
        self.cache: dict = {}  # what is read through this handle (the column table)
        try:
            self.file = h5py.File(path, "r")
        except Exception as error:  # noqa: BLE001 - a hostile file may make h5py raise anything
            problem = not_hdf5_hint(path) or f"not a readable HDF5 file ({_short(error)})"
            raise PackError(f"{path}: {problem}") from None
        try:
            self.maps = self._checked_maps()
        except PackError:
            self.file.close()
            raise
        except Exception as error:  # noqa: BLE001 - h5py on a damaged file: anything
            self.file.close()
            raise PackError(f"{path}: damaged HDF5 file ({_short(error)})") from None
        except BaseException:
            self.file.close()
            raise

    def _checked_maps(self) -> dict[str, np.ndarray]:
        """Check every dataset (NOTE [ Only the HDF5 layout we write ]) and map its bytes."""
        path = self.path
        try:
            names = set(self.file.keys())
        except Exception as error:  # noqa: BLE001
            raise PackError(f"{path}: damaged HDF5 file ({_short(error)})") from None
        if "metadata" not in names:
            raise PackError(
                f"{path}: not a complete fastloader pack (no metadata: an interrupted "
                f"fastloader-pack run, or an hdf5 file written by something else)"
            )
        columns = {name for name in names if _COLUMN_NAME.fullmatch(str(name))}
        expected = dict.fromkeys(columns, _UINT8) if columns else dict(_REQUIRED)
        expected["metadata"] = _UINT8
        if names & set(_SOURCES):
            expected.update(_SOURCES)
        if names != set(expected):
            strange = sorted(str(name) for name in names ^ set(expected))  # names may be bytes
            raise PackError(f"{path}: not a fastloader pack (unexpected datasets {strange})")
        return {name: self._map(name, dtype) for name, dtype in expected.items()}

    def _map(self, name: str, dtype: np.dtype) -> np.ndarray:
        path = self.path
        try:
            link = self.file.get(name, getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise PackError(f"{path}: not a fastloader pack ({name} is a link elsewhere)")
            dataset = self.file[name]
            if not isinstance(dataset, h5py.Dataset):
                raise PackError(f"{path}: not a fastloader pack ({name} is not a dataset)")
            plist = dataset.id.get_create_plist()
            layout, filters = plist.get_layout(), plist.get_nfilters()
            external = plist.get_external_count()
            shape, stored_dtype = dataset.shape, dataset.dtype
            offset = dataset.id.get_offset()
            storage = dataset.id.get_storage_size()
        except PackError:
            raise
        except Exception as error:  # noqa: BLE001
            raise PackError(f"{path}: damaged HDF5 file at {name} ({_short(error)})") from None
        if layout != h5py.h5d.CONTIGUOUS or filters or external:
            raise PackError(
                f"{path}: not a fastloader pack ({name} is not stored contiguously in the file: "
                f"chunked, filtered, external or virtual storage is refused)"
            )
        if stored_dtype != dtype or shape is None or len(shape) != 1:
            raise PackError(f"{path}: not a fastloader pack ({name} is {stored_dtype} {shape})")
        nbytes = shape[0] * dtype.itemsize
        if nbytes == 0:
            return np.zeros(0, dtype)
        if offset is None or storage != nbytes or offset + nbytes > self.size:
            raise PackError(
                f"{path}: truncated or damaged HDF5 file ({name} declares {nbytes} bytes at "
                f"offset {offset}; the file has {self.size})"
            )
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)

    def close(self) -> None:
        self.maps = {}
        self.file.close()


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


class HDF5Pack(PackFile):
    """The torch-free reader of a pack written by ``fastloader-pack`` in HDF5 format.

    ``--info``, ``--verify`` and ``read_metadata`` use it; ``HDF5Dataset``
    (fastloader/datasets/packs.py) is this reader with decoding and transforms. Arguments and errors
    as ``PackFile``.
    """

    backend = "hdf5"

    def _open(self) -> _Handle:
        return _Handle(self.path)

    def _close_handle(self, handle: _Handle) -> None:
        handle.close()

    def _load_index(self, handle: _Handle) -> tuple[dict, np.ndarray]:
        maps = handle.maps
        metadata = load_metadata(maps["metadata"].tobytes(), self.path, self.backend)
        count = metadata["count"]
        if "columns" in metadata:
            return self._load_columns(handle, metadata)
        if (
            "offsets" not in maps
            or len(maps["offsets"]) != count + 1
            or ("sources" in maps) != metadata["sources"]
        ):
            raise PackError(f"{self.path}: corrupt pack (the datasets do not fit the metadata)")
        offsets = np.array(maps["offsets"])
        check_array(offsets, "offsets", metadata, self.path)
        if offsets[0] != 0 or offsets[-1] != len(maps["records"]) or np.any(np.diff(offsets) < 0):
            raise PackError(f"{self.path}: corrupt pack (record offsets do not fit the data)")
        if metadata["sources"]:
            self._check_sources(maps, metadata)
        self._offsets = offsets
        return metadata, check_targets(np.array(maps["targets"]), metadata, self.path)

    def _load_columns(self, handle: _Handle, metadata: dict) -> tuple[dict, np.ndarray]:
        self.metadata = metadata  # the table reads it
        names = {name for name in handle.maps if _COLUMN_NAME.fullmatch(name)}
        expected = {
            part_name(number, "data") for number in range(len(metadata["schema"]["fields"]))
        }
        expected |= {
            part_name(number, "sums") for number in range(len(metadata["schema"]["fields"]))
        }
        for number, column in enumerate(metadata["columns"]["fields"]):
            if column["storage"] == "ragged":
                expected.add(part_name(number, "offsets"))
                if metadata["schema"]["fields"][number]["kind"] in ("array", "image"):
                    expected.add(part_name(number, "heads"))
        if names != expected or ("sources" in handle.maps) != metadata["sources"]:
            raise PackError(f"{self.path}: corrupt pack (the datasets do not fit the metadata)")
        if metadata["columns"]["rows_per_segment"] < metadata["count"]:
            raise PackError(f"{self.path}: corrupt metadata (columns cut into segments)")
        if metadata["sources"]:
            self._check_sources(handle.maps, metadata)
        self._column_table(handle)  # every part checked when the dataset is made
        return metadata, np.broadcast_to(np.int64(0), (metadata["count"],))

    def _check_sources(self, maps: dict, metadata: dict) -> None:
        bounds = maps["source_offsets"]
        if len(bounds) != metadata["count"] + 1:
            raise PackError(f"{self.path}: corrupt pack (source path offsets do not fit)")
        check_array(bounds, "source_offsets", metadata, self.path)
        check_array(maps["sources"], "sources", metadata, self.path)
        if bounds[0] != 0 or bounds[-1] != len(maps["sources"]) or np.any(np.diff(bounds) < 0):
            raise PackError(f"{self.path}: corrupt pack (source path offsets do not fit)")

    def _handle_cache(self, handle: _Handle) -> dict:
        return handle.cache

    def _column_part(self, handle: _Handle, name: str, segment: int) -> np.ndarray | None:
        return handle.maps.get(name) if segment == 0 else None

    def _read_source(self, handle: _Handle, position: int) -> bytes:
        bounds = handle.maps["source_offsets"]
        start, end = int(bounds[position]), int(bounds[position + 1])
        if not 0 <= start <= end <= len(handle.maps["sources"]):
            raise PackError(f"{self.path}: damaged source path of record {position}")
        return handle.maps["sources"][start:end].tobytes()

    def _record_spans(
        self, handle: _Handle, positions: Sequence[int], advice: Any
    ) -> tuple[mmap.mmap, Any] | None:
        # For read advice (formats/advice.py): the records' spans in the map numpy made of the
        # records block, which starts ``base`` bytes into that map (an aligned offset).
        records = handle.maps.get("records")
        file = getattr(records, "_mmap", None)
        if file is None:  # an empty block: nothing to advise
            return None
        base = records.ctypes.data - np.frombuffer(file, np.uint8).ctypes.data
        at = np.asarray(positions, dtype=np.int64)
        starts = self._offsets[at]
        lengths = self._offsets[at + 1] - starts
        return file, zip((starts + base).tolist(), lengths.tolist(), strict=True)

    def _read_each(self, handle: _Handle, indices: Sequence[int], use: Callable) -> list:
        records = memoryview(handle.maps["records"])  # slices: plain views, no memmap objects
        offsets = self._offsets
        return [use(index, records[offsets[index] : offsets[index + 1]]) for index in indices]


class HDF5Writer(PackWriter):
    """Writes an HDF5 pack to exactly ``path``; the file is complete only after ``close()``.

    Arguments and errors as ``PackWriter``.
    """

    backend = "hdf5"

    def _open(self) -> None:
        self._file = h5py.File(self.path, "x")  # "x" raises FileExistsError
        # Records are spooled here until close(): see NOTE [ Contiguous HDF5 records ].
        self._spool = tempfile.TemporaryFile(dir=self.path.parent, prefix=f".{self.path.name}.")
        self._offsets = array("q", [0])

    def _put(self, record: bytes) -> None:
        self._spool.write(record)
        self._offsets.append(self._offsets[-1] + len(record))

    def close(self) -> None:
        """Write the records block, offsets, labels, sources and metadata: now complete."""
        records = self._file.create_dataset("records", shape=(self.bytes_written,), dtype=np.uint8)
        self._spool.seek(0)
        start = 0
        while block := self._spool.read(_COPY_BYTES):
            records[start : start + len(block)] = np.frombuffer(block, dtype=np.uint8)
            start += len(block)
        self._spool.close()
        arrays = self.arrays()
        arrays["offsets"] = np.frombuffer(self._offsets, dtype=np.int64).astype("<i8")
        names = {"labels": "targets"}
        for name, data in arrays.items():
            self._file.create_dataset(names.get(name, name), data=data)
        metadata = np.frombuffer(self.metadata_json(arrays), dtype=np.uint8)
        self._file.create_dataset("metadata", data=metadata)
        self._file.close()

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        self._spool.close()
        self._file.close()


class HDF5ColumnWriter(HDF5Writer):
    """Writes an HDF5 pack of fields laid out by columns (format 5) to exactly ``path``: one
    contiguous dataset per column part (NOTE [ Packs laid out by columns ]). Arguments and
    errors as ``PackWriter``."""

    def _open(self) -> None:
        # a column's rows start on a page: aligned for any dtype, a row spans no more pages
        # than its size needs (a row of 12 KiB: 3, not 4)
        self._file = h5py.File(self.path, "x", alignment_threshold=4096, alignment_interval=4096)
        self._spool = None

    def _put(self, record: bytes) -> None:
        if self._spool is None:
            self._spool = ColumnSpool(self.schema, self.path.parent)
        self._spool.add(record)

    def close(self) -> None:
        """Write every column part, the source paths and the metadata: now complete."""
        small = {}
        for name, _, data in self._spool.parts(None):
            dataset = self._file.create_dataset(name, shape=(len(data),), dtype=np.uint8)
            for start in range(0, len(data), _COPY_BYTES):
                dataset[start : start + _COPY_BYTES] = data[start : start + _COPY_BYTES]
            if not name.endswith(".data"):
                small[name] = data
        self.columns = self._spool.layout
        arrays = self.arrays()
        if "sources" in arrays:
            for name in ("sources", "source_offsets"):
                self._file.create_dataset(name, data=arrays[name])
                small[name] = arrays[name]
        metadata = np.frombuffer(self.metadata_json(small), dtype=np.uint8)
        self._file.create_dataset("metadata", data=metadata)
        self._file.close()
        self._spool.close()

    def abort(self) -> None:
        if self._spool is not None:
            self._spool.close()
        self._file.close()
