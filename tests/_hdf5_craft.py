"""Damaged HDF5 files crafted from valid ones: h5py writes the file, its low-level API says where
a chunk's index entry lies, and bytes of that entry or of the chunk are patched."""

from __future__ import annotations

import struct
from pathlib import Path

import h5py


def chunk_info(path: Path, name: str, index: int) -> h5py.h5d.StoreInfo:
    """Chunk ``index`` of dataset ``name``: chunk_offset, filter_mask, byte_offset, size."""
    with h5py.File(path, "r") as file:
        return file[name].id.get_chunk_info(index)


def _index_entry(data: bytes, info: h5py.h5d.StoreInfo) -> int:
    """Where the version-1 B-tree key of the chunk ``info`` starts (h5py's default format): a
    u32 stored size, a u32 filter mask, the chunk's offsets and a 0 as u64s, then the child's
    address, the chunk's byte offset."""
    rank = len(info.chunk_offset)
    key = struct.pack(f"<II{rank + 1}QQ", info.size, info.filter_mask, *info.chunk_offset, 0,
                      info.byte_offset)  # fmt: skip
    assert data.count(key) == 1, "the chunk's index entry is not found once"
    return data.index(key)


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
    at = _index_entry(bytes(data), info)
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
