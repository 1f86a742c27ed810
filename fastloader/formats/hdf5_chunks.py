"""Chunks of a user's HDF5 dataset: their index entries checked against the layout before use.

NOTE [ Chunks checked before h5py reads them ]
HDF5 trusts a chunk's entry in the dataset's chunk index (address, stored size, filter mask).
An unfiltered chunk whose stored size is short is read into a buffer of the chunk's full size
and the rest handed out uninitialised: 25 of 36 bytes read as 6 values and heap garbage that
differed between runs and processes (issue 39), a leak of process memory into training data;
a filter pipeline whose output is short (a deflate stream that ends early, a shuffled chunk
cut short) does the same. So chunks are checked against the layout the dataset declares
before h5py reads them, in two steps.
- When the dataset is created, the whole index is walked once (``H5Dchunk_iter``, a few us a
  chunk): every entry's address and stored size lie inside the file, the size is not 0, and
  a chunk the mask leaves unfiltered (no filters, or all the declared ones skipped; HDF5 reads
  only the bits of declared filters) is stored in exactly the chunk's bytes, chunk shape x
  stored element size (16 bytes for a variable-length string's heap ID with 8-byte
  addresses). That holds for every process: the file's identity is checked before every
  batch (NOTE [ A file changed under a reader ] in hdf5_foreign.py).
- A filtered chunk's output size is known only by running its pipeline. For deflate, shuffle
  and Fletcher-32 only (h5py's ``compression="gzip"``, ``shuffle``, ``fletcher32``), each
  chunk is checked the first time a process reads it (by slabs of rows: all chunks of a range
  of first-dimension indices): its stored bytes are read as HDF5 will read them
  (``H5Dread_chunk``, one index lookup) into a buffer of twice the chunk's bytes + 4 KiB (a
  hostile size allocates nothing more), the pipeline's output size computed in reverse order
  (Fletcher-32's 4 bytes off, deflate inflated, bounded at the chunk's bytes + 1, shuffle
  unchanged), and it must be the chunk's bytes: a gzip chunk is inflated twice the first time
  a process reads it. Other filters (LZF, SZIP, N-bit, scale-offset, plugins) size their own
  output: their chunks get the first step only. A chunk the index does not list was never
  written and reads as the fill value, as in h5py.
(``H5Dget_chunk_info_by_coord`` walks the whole index each call, 3 ms at 20 000 chunks, and
``H5Dread_chunk`` of an unfiltered dataset reads the chunk's full size whatever the index
says, so neither checks an unfiltered chunk lazily.) A file written with HDF5's option to leave
partial edge chunks unfiltered (which h5py cannot write) has those chunks refused. A chunk
that fails is a PackError naming the file, the dataset, the chunk and the rows it holds.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from typing import NamedTuple

import h5py
import numpy as np

__all__ = ["ChunkLayout", "chunk_layout", "chunk_problem", "index_problem", "written_chunks"]

_DEFLATE, _SHUFFLE, _FLETCHER32 = (
    h5py.h5z.FILTER_DEFLATE,
    h5py.h5z.FILTER_SHUFFLE,
    h5py.h5z.FILTER_FLETCHER32,
)
_SIZED = {_DEFLATE, _SHUFFLE, _FLETCHER32}  # filters whose output size we compute


class ChunkLayout(NamedTuple):
    """What a chunked dataset declares about its chunks."""

    shape: tuple[int, ...]  # the chunk shape
    nbytes: int  # the bytes of one chunk, unfiltered, as stored
    filters: tuple[int, ...]  # the filter codes, in the order they are applied when writing


def chunk_layout(dataset: h5py.Dataset) -> ChunkLayout | None:
    """The chunk layout of ``dataset``, or None if it is not chunked."""
    plist = dataset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CHUNKED:
        return None
    shape = tuple(int(size) for size in plist.get_chunk())
    filters = tuple(int(plist.get_filter(index)[0]) for index in range(plist.get_nfilters()))
    stored = dataset.id.get_type()
    if isinstance(stored, h5py.h5t.TypeStringID) and stored.is_variable_str():
        address = dataset.file.id.get_create_plist().get_sizes()[0]
        itemsize = 4 + address + 4  # a heap ID: length, collection address, object index
    else:
        itemsize = stored.get_size()
    return ChunkLayout(shape, math.prod(shape) * itemsize, filters)


def index_problem(
    dsid: h5py.h5d.DatasetID, layout: ChunkLayout, rows: int, file_size: int
) -> str | None:
    """What is wrong with the entries of a chunked dataset's index (of ``rows`` rows), or
    None: the first step of NOTE [ Chunks checked before h5py reads them ]."""
    unfiltered = (1 << len(layout.filters)) - 1  # the mask that skips every declared filter

    def check(info: h5py.h5d.StoreInfo) -> str | None:
        size, offset = info.size, info.byte_offset
        if offset is None or not size or offset + size > file_size:
            problem = f"claims {size} bytes at offset {offset}, outside the file ({file_size})"
        elif info.filter_mask & unfiltered == unfiltered and size != layout.nbytes:
            problem = (
                f"is stored unfiltered in {size} bytes where its layout needs {layout.nbytes} "
                f"(chunk shape x element size)"
            )
        else:
            return None
        return _named(tuple(info.chunk_offset), layout, rows) + problem

    return dsid.chunk_iter(check)


def _named(coord: tuple[int, ...], layout: ChunkLayout, rows: int) -> str:
    last = min(coord[0] + layout.shape[0], rows) - 1
    return f"its chunk at {coord} (rows {coord[0]}-{last}) "


def chunk_problem(
    dsid: h5py.h5d.DatasetID,
    layout: ChunkLayout,
    slabs: np.ndarray,
    shape: tuple[int, ...],
    written: Callable[[], set[tuple[int, ...]]],
) -> str | None:
    """What is wrong with the filtered chunks of ``slabs`` (first-dimension chunk indices) of a
    dataset of ``shape``, or None; ``written()`` gives the coordinates of the chunks the index
    lists: the second step of NOTE [ Chunks checked before h5py reads them ]."""
    others = [
        range(0, int(size), step) for size, step in zip(shape[1:], layout.shape[1:], strict=True)
    ]
    buffer = np.empty(2 * layout.nbytes + 4096, dtype=np.uint8)
    for slab in slabs.tolist():
        first = slab * layout.shape[0]
        for rest in itertools.product(*others):
            coord = (first, *rest)
            problem = _one_chunk(dsid, coord, layout, buffer, written)
            if problem is not None:
                return _named(coord, layout, shape[0]) + problem
    return None


def written_chunks(dsid: h5py.h5d.DatasetID) -> set[tuple[int, ...]]:
    """The coordinates of every chunk the dataset's index lists (one walk of the index)."""
    found: set[tuple[int, ...]] = set()
    dsid.chunk_iter(lambda info: found.add(tuple(info.chunk_offset)))
    return found


def _one_chunk(
    dsid: h5py.h5d.DatasetID,
    coord: tuple[int, ...],
    layout: ChunkLayout,
    buffer: np.ndarray,
    written: Callable[[], set[tuple[int, ...]]],
) -> str | None:
    try:
        mask, raw = dsid.read_direct_chunk(coord, out=buffer)
    except Exception as error:  # noqa: BLE001 - HDF5 on a damaged index: anything
        if coord not in written():
            return None  # never written: the fill value
        error_text = " ".join(str(error).split())[:200]
        return f"cannot be read as a chunk of {layout.nbytes} bytes ({error_text})"
    applied = [code for index, code in enumerate(layout.filters) if not mask >> index & 1]
    if not applied or not set(applied) <= _SIZED:
        return None  # unfiltered: checked with the index; or filters that size their output
    size = _output_size(raw, applied, layout.nbytes)
    if size != layout.nbytes:
        return (
            f"unfilters to {size if size >= 0 else 'an incomplete stream of'} bytes where its "
            f"layout needs {layout.nbytes} (chunk shape x element size)"
        )
    return None


def _output_size(raw: bytes, applied: list[int], nbytes: int) -> int:
    """The size the read pipeline (``applied`` reversed) makes of ``raw``; -1 for a deflate
    stream that does not end (truncated, or inflating past ``nbytes``)."""
    data = raw
    for code in reversed(applied):
        if code == _FLETCHER32:
            if len(data) < 4:
                return -1
            data = data[:-4]
        elif code == _DEFLATE:
            inflater = zlib.decompressobj()
            try:
                data = inflater.decompress(data, nbytes + 1)
            except zlib.error:
                return -1
            if not inflater.eof:
                return -1
    return len(data)
