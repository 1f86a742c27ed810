"""Variable-length strings of a user's HDF5 file: their global heap checked before h5py reads.

NOTE [ Global heap checked before h5py ]
A variable-length string is stored as a heap ID (its length, the address of a global heap
collection, an object index); the bytes lie in that collection, a block of objects each with
a 16-byte header giving its size. HDF5 follows those sizes without checking them against the
collection: one damaged object size made h5py spin for minutes (at 100 % CPU, never
returning) on a 14 KB file in the fuzzing of issue 27, where fastloader, reading through h5py,
hung with it. So before h5py reads a variable-length field's rows, the collections they point
into are parsed here, in fastloader's own map of the file, and every object's header and size
is checked to fit its collection, the collection to fit the file, and each row's heap ID to name
an object that holds its length; a collection is checked once per process. Only contiguous
variable-length datasets (what ``create_dataset`` writes without ``chunks``) can be checked
this way: their heap IDs are plain bytes of the file.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["HEAP_ID_SIZE", "check_heap_ids"]

HEAP_ID_SIZE = 16  # u32 length, u64 collection address, u32 object index
_COLLECTION = struct.Struct("<4sB3xQ")  # "GCOL", version 1, reserved, collection size
_OBJECT = struct.Struct("<HH4xQ")  # index, reference count, reserved, size
_IDS = np.dtype([("length", "<u4"), ("collection", "<u8"), ("index", "<u4")])
_UNDEFINED = (1 << 64) - 1


def check_heap_ids(
    file: bytes | memoryview, offset: int, rows: np.ndarray, per_row: int, checked: dict
) -> str | None:
    """Check the heap IDs of ``rows`` (``per_row`` strings each) of a contiguous dataset whose
    IDs start at ``offset``; ``checked`` caches collections already parsed (address: their
    objects' sizes, or None if damaged). Returns what is wrong, or None."""
    first = np.asarray(rows, dtype=np.int64)[:, None] * per_row + np.arange(per_row)
    ids = np.frombuffer(file, _IDS, int(first.max()) + 1, offset)[first.ravel()]
    ids = ids[ids["collection"] != 0]  # 0: an empty or unwritten string (no heap object)
    for collection in np.unique(ids["collection"]).tolist():
        if collection not in checked:
            checked[collection] = _objects(file, collection)
        objects = checked[collection]
        if objects is None:
            return f"its global heap collection at {collection} is damaged"
        mine = ids[ids["collection"] == collection]
        for index, length in zip(mine["index"].tolist(), mine["length"].tolist(), strict=True):
            size = objects.get(index)
            if size is None or length > size:
                return f"a string's heap object {index} at {collection} is missing or too short"
    return None


def _objects(file: bytes | memoryview, address: int) -> dict[int, int] | None:
    """The object sizes of the collection at ``address``, or None if it does not parse."""
    if address == _UNDEFINED or address + _COLLECTION.size > len(file):
        return None
    magic, version, size = _COLLECTION.unpack_from(file, address)
    end = address + size
    if magic != b"GCOL" or version != 1 or size < _COLLECTION.size or end > len(file):
        return None
    objects: dict[int, int] = {}
    at = address + _COLLECTION.size
    while at + _OBJECT.size <= end:
        index, _, length = _OBJECT.unpack_from(file, at)
        need = length if index == 0 else _OBJECT.size + (length + 7) // 8 * 8
        if index in objects or need < _OBJECT.size or need > end - at:
            return None  # a repeated index, or a size that does not fit the collection
        if index:
            objects[index] = length
        at += need
    return objects
