"""Damaged HDF5 files crafted from valid ones: h5py writes the file, its low-level API gives a
chunk's index entry (found in the file as the structural fuzz finds it), and bytes of that
entry or of the chunk are patched."""

from __future__ import annotations

import struct
from pathlib import Path

import h5py

from benchmarks.fuzz_users import hdf5_chunk_key


def chunk_info(path: Path, name: str, index: int) -> h5py.h5d.StoreInfo:
    """Chunk ``index`` of dataset ``name``: chunk_offset, filter_mask, byte_offset, size."""
    with h5py.File(path, "r") as file:
        return file[name].id.get_chunk_info(index)


def patch_chunk(
    path: Path,
    name: str,
    index: int,
    *,
    size: int | None = None,
    mask: int | None = None,
    address: int | None = None,
    payload: bytes | None = None,
) -> h5py.h5d.StoreInfo:
    """Rewrite chunk ``index``'s index entry (stored ``size``, filter ``mask``, ``address``)
    and/or its bytes (``payload``, written at its address); returns the chunk's original
    entry."""
    info = chunk_info(path, name, index)
    data = bytearray(path.read_bytes())
    key = hdf5_chunk_key(info)  # the chunk's entry in the index
    assert data.count(key) == 1, "the chunk's index entry is not found once"
    at = data.index(key)
    if size is not None:
        struct.pack_into("<I", data, at, size)
    if mask is not None:
        struct.pack_into("<I", data, at + 4, mask)
    if address is not None:
        struct.pack_into("<Q", data, at + 8 + 8 * (len(info.chunk_offset) + 1), address)
    if payload is not None:
        data[info.byte_offset : info.byte_offset + len(payload)] = payload
    path.write_bytes(bytes(data))
    return info
