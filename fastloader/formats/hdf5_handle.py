"""A user's HDF5 file open in one process: h5py's handle, fastloader's map of it, and what was
checked in this process before h5py reads (NOTE [ Global heap checked before h5py ] in
hdf5_heap.py, NOTE [ Chunks checked before h5py reads them ] in hdf5_chunks.py)."""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fastloader.formats.hdf5_chunks import chunk_problem, written_chunks
from fastloader.formats.hdf5_heap import check_heap_ids
from fastloader.formats.records import PackError

__all__ = ["FileHandle", "items", "short_error"]


def short_error(error: BaseException) -> str:
    """An exception's message on one line, at most 200 characters."""
    return " ".join(str(error).split())[:200] or type(error).__name__


def items(shape: tuple[int, ...]) -> int:
    """The number of items of ``shape``."""
    return math.prod(int(size) for size in shape)  # Python ints: np.prod cost 5 us a call


class FileHandle:
    """An open file in one process: h5py's handle and our map of it (``size`` bytes)."""

    def __init__(self, path: Path, size: int) -> None:
        try:
            self.file = h5py.File(path, "r")
        except Exception as error:  # noqa: BLE001 - a damaged file may make h5py raise anything
            raise PackError(f"{path}: not a readable HDF5 file ({short_error(error)})") from None
        with open(path, "rb") as opened:
            self.map = mmap.mmap(opened.fileno(), size, access=mmap.ACCESS_READ)
        self.path, self.size = path, size
        self.datasets: dict[str, h5py.Dataset] = {}
        self.heaps: dict[int, dict | None] = {}  # global heap collections checked here
        self.heap_rows: dict[str, np.ndarray] = {}  # rows whose heap IDs were checked
        self.chunk_slabs: dict[str, np.ndarray] = {}  # slabs of rows whose chunks were checked
        self.written: dict[str, set] = {}  # chunks each dataset's index lists, if needed
        self.mapped: dict[str, np.ndarray] = {}  # field -> its rows as an array of the map

    def dataset(self, name: str) -> h5py.Dataset:
        dataset = self.datasets.get(name)
        if dataset is None:
            dataset = self.datasets[name] = self.file[name]
        return dataset

    def check_heap(self, field: Any, rows: np.ndarray, count: int) -> None:
        """Check the heap IDs of ``field``'s ``rows`` (of ``count``) not checked yet here."""
        if field.heap_ids is None:
            return
        seen = self.heap_rows.get(field.name)
        if seen is None:
            seen = self.heap_rows[field.name] = np.zeros(count, dtype=bool)
        rows = rows[~seen[rows]]
        if not len(rows):
            return
        per_row = items(field.row_shape)
        problem = check_heap_ids(self.map, field.heap_ids, rows, per_row, self.heaps)
        if problem is not None:
            raise PackError(f"{self.path}: dataset {field.name!r} is damaged ({problem})")
        seen[rows] = True

    def check_chunks(self, field: Any, rows: np.ndarray, count: int) -> None:
        """Check the chunks ``field``'s ``rows`` (of ``count``) lie in, not checked yet here."""
        layout = field.chunks
        if layout is None:
            return
        seen = self.chunk_slabs.get(field.name)
        if seen is None:
            slabs = -(-count // layout.shape[0])
            seen = self.chunk_slabs[field.name] = np.zeros(slabs, dtype=bool)
        slabs = np.unique(rows // layout.shape[0])
        slabs = slabs[~seen[slabs]]
        if not len(slabs):
            return
        dsid = self.dataset(field.name).id
        shape = (count, *field.row_shape)
        problem = chunk_problem(dsid, layout, slabs, shape, lambda: self._written(field.name))
        if problem is not None:
            raise PackError(f"{self.path}: dataset {field.name!r} is damaged: {problem}")
        seen[slabs] = True

    def _written(self, name: str) -> set[tuple[int, ...]]:
        """The chunks dataset ``name``'s index lists, walked once in this process."""
        found = self.written.get(name)
        if found is None:
            found = self.written[name] = written_chunks(self.dataset(name).id)
        return found

    def close(self) -> None:
        self.datasets = {}
        self.mapped = {}
        self.file.close()
        try:
            self.map.close()
        except BufferError:  # a row view still alive: unmapped when the last one goes
            pass
