"""Chunks of a user's HDF5 dataset: their index entries checked against the layout before use.

NOTE [ Chunks checked before h5py reads them ]
HDF5 trusts a chunk's entry in the dataset's chunk index (address, stored size, filter mask).
An unfiltered chunk whose stored size is short is read into a buffer of the chunk's full size
and the rest handed out uninitialised: 25 of 36 bytes read as 6 values and heap garbage that
differed between runs and processes (issue 39), a leak of process memory into training data;
a filter pipeline whose output is short (a deflate stream that ends early, a shuffled chunk
cut short) does the same. So before h5py reads rows of a chunked dataset, every chunk they
touch is checked once per process (by slabs of rows: all chunks of a range of first-dimension
indices) against the layout the dataset declares:
- its address and stored size lie inside the file, and the size is not 0;
- the filters its mask leaves applied (HDF5 reads only the bits of declared filters);
- with none applied (no filters, or all skipped by the mask): the stored size is exactly the
  chunk's bytes, chunk shape x stored element size (16 bytes for a variable-length string's
  heap ID with 8-byte addresses);
- with deflate, shuffle and Fletcher-32 only (h5py's ``compression="gzip"``, ``shuffle``,
  ``fletcher32``): the chunk is read raw (``H5Dread_chunk``) and the pipeline's output size
  computed in reverse order (Fletcher-32's 4 bytes off, deflate inflated, bounded at the chunk's
  bytes + 1, shuffle unchanged): it must be the chunk's bytes. A gzip chunk is thus inflated
  twice the first time a process reads it. Other filters (LZF, SZIP, N-bit, scale-offset,
  plugins) size their own output: their chunks get the address and size checks only.
A chunk with no address was never written and reads as the fill value, as in h5py. A chunk
that fails is a PackError naming the file, the dataset, the chunk and the rows it holds.
"""

from __future__ import annotations

import itertools
import math
import zlib
from typing import NamedTuple

import h5py
import numpy as np

__all__ = ["ChunkLayout", "chunk_layout", "chunk_problem"]

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


def chunk_problem(
    dsid: h5py.h5d.DatasetID,
    layout: ChunkLayout,
    slabs: np.ndarray,
    shape: tuple[int, ...],
    file_size: int,
) -> str | None:
    """What is wrong with the chunks of ``slabs`` (first-dimension chunk indices) of a dataset
    of ``shape``, or None (NOTE [ Chunks checked before h5py reads them ])."""
    others = [
        range(0, int(size), step) for size, step in zip(shape[1:], layout.shape[1:], strict=True)
    ]
    for slab in slabs.tolist():
        first = slab * layout.shape[0]
        for rest in itertools.product(*others):
            coord = (first, *rest)
            problem = _one_chunk(dsid, coord, layout, file_size)
            if problem is not None:
                rows = f"rows {first}-{min(first + layout.shape[0], shape[0]) - 1}"
                return f"its chunk at {coord} ({rows}) {problem}"
    return None


def _one_chunk(
    dsid: h5py.h5d.DatasetID, coord: tuple[int, ...], layout: ChunkLayout, file_size: int
) -> str | None:
    info = dsid.get_chunk_info_by_coord(coord)
    if info.byte_offset is None:
        return None  # never written: the fill value
    if not info.size or info.byte_offset + info.size > file_size:
        return (
            f"claims {info.size} bytes at offset {info.byte_offset}, outside the file "
            f"({file_size} bytes)"
        )
    applied = [
        code for index, code in enumerate(layout.filters) if not info.filter_mask >> index & 1
    ]
    if not applied:
        if info.size != layout.nbytes:
            return (
                f"is stored unfiltered in {info.size} bytes where its layout needs "
                f"{layout.nbytes} (chunk shape x element size)"
            )
        return None
    if not set(applied) <= _SIZED:
        return None  # a filter that sizes its own output: see the NOTE
    _, raw = dsid.read_direct_chunk(coord)
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
