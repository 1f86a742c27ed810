"""Rows of a memory-mapped field, gathered only when their destination is known."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MappedRows", "RowsToGather", "gathered"]


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

    def into(self, out: np.ndarray) -> None:
        # "clip" is never used (the rows are in range) but, unlike "raise", copies unbuffered
        np.take(self.source, self.rows, axis=0, out=out, mode="clip")


def gathered(column: Any) -> Any:
    """``column``, gathered into an array if it is ``RowsToGather``."""
    return column.array() if isinstance(column, RowsToGather) else column
