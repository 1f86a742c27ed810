"""Rows of a memory-mapped field, gathered only when their destination is known."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

__all__ = ["PAGE", "MappedRows", "RowsToGather", "address_of", "gathered"]

PAGE = 4096  # bytes of a memory page: NOTE [ Gathered into the batch tensor ]


class RowsToGather:
    """Rows of a batch column not copied yet: ``array()`` gathers them into a new array,
    ``into(out)`` straight into ``out`` (a batch tensor's array, a worker's shared-memory
    slot); ``dtype``, ``shape`` and ``nbytes`` are the gathered array's."""

    __slots__ = ()
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int

    def array(self) -> np.ndarray:
        raise NotImplementedError

    def into(self, out: np.ndarray) -> None:
        raise NotImplementedError

    def source_address(self) -> int | None:
        """The address the batch tensor is placed to match modulo ``PAGE`` (NOTE [ Gathered
        into the batch tensor ] in datasets/collate.py): the source's, where the rows are
        gathered from one array (``MappedRows``) or lie whole pages from one address; else
        None (the tensor stays where it was allocated)."""
        return None


class MappedRows(RowsToGather):
    """Rows ``rows`` (checked in range) of the mapped array ``source``, not yet copied.

    ``array()`` gathers them into a new array, as ``source[rows]``; ``into(out)`` gathers them
    straight into ``out`` (a worker's shared-memory slot: NOTE [ Batches read by columns ] in
    datasets/columns.py), one copy instead of a gather and a copy.
    """

    __slots__ = ("source", "rows")

    def __init__(self, source: np.ndarray, rows: np.ndarray) -> None:
        self.source = source
        self.rows = rows

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.source.shape[1:])

    @property
    def nbytes(self) -> int:
        return len(self.rows) * self.source[:1].nbytes

    def array(self) -> np.ndarray:
        return self.source[self.rows]

    def source_address(self) -> int | None:
        return address_of(self.source)

    def into(self, out: np.ndarray) -> None:
        # "clip" is never used (the rows are in range) but, unlike "raise", copies unbuffered
        np.take(self.source, self.rows, axis=0, out=out, mode="clip")


def gathered(column: Any) -> Any:
    """``column``, gathered into an array if it is ``RowsToGather``."""
    return column.array() if isinstance(column, RowsToGather) else column


#: id of a mapped source -> (a weak reference to it, its address): asked once per source
#: (``__array_interface__`` costs 4 us, twice a column's ``from_numpy``)
_ADDRESSES: dict[int, tuple[Any, int]] = {}


def address_of(array: np.ndarray) -> int:
    """The address of ``array``'s data (remembered for a view of a map)."""
    known = _ADDRESSES.get(id(array))
    if known is not None and known[0]() is array:
        return known[1]
    address = array.__array_interface__["data"][0]
    if array.base is None:  # an array of its own (a spare): not kept
        return address
    if len(_ADDRESSES) >= 256:
        _ADDRESSES.clear()
    _ADDRESSES[id(array)] = (weakref.ref(array), address)
    return address
