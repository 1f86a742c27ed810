"""One gather per column across the open shards of a sharded pack (NOTE [ One gather across
shards ])."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastloader.formats.mapped_rows import RowsToGather

__all__ = ["ScatteredRows", "ShardMaps", "gather_rows"]

# NOTE [ One gather across shards ]
# A shuffled batch of 64 reads 2-3 rows from each of up to lanes x window (32) shards. Read per
# shard (grouped, each shard's column table asked for its rows, the rows copied into the batch
# one by one) it cost ~25 us of Python per shard, 570 us a batch against 14 us for one pack's
# (19 shards of 64x64x3 images), so a warm epoch from the cache ran at half one pack's speed.
# So each process keeps, for every shard it has open and checked, the address of each fixed
# column's rows in its map (``ShardMaps``), and a batch whose shards are all ready is read
# with no Python per shard or per row: the shard of every index is one ``searchsorted``, each
# row's address one multiply-add, and each column one gather of rows by address, straight into
# the batch tensor or the worker's shared-memory slot as one pack's rows are (``ScatteredRows``,
# read like ``MappedRows``). The gather is torch's ``index_select`` over a view of the memory
# that spans the batch's rows, one "row" starting at every byte (strides (1, 1)): an index is
# then a row's offset from the lowest row, and the kernel copies each row whole. Only the rows
# of the batch are touched (the view also spans unrelated memory between the maps: it is
# never read, and nothing but this gather sees the view). Every address is of a row checked in
# range (the row is below the shard's count, which is the manifest's and its map's), in a map
# that stays mapped while the batch's ``ScatteredRows`` keeps the shards' column tables.
# A shard is ready once every block of it has been checked in this process (at its open: the
# same hashing the batches would do block by block, before any row is read) and when each
# column the batch takes by rows is one native-order segment (every LMDB shard under 256 MB,
# every HDF5 shard) stored as the first ready shard stores it; ragged and text columns are read
# per shard as before (sharded_columns.py), and a batch with a shard not ready goes that way.


class ScatteredRows(RowsToGather):
    """Rows of one fixed column of several shards, by address, not yet copied: read as
    ``MappedRows`` (``array()``, ``into(out)``); ``keep`` holds their maps (NOTE [ One gather
    across shards ])."""

    __slots__ = ("addresses", "dtype", "row_shape", "width", "keep")

    def __init__(
        self, addresses: np.ndarray, dtype: np.dtype, row_shape: tuple, width: int, keep: Any
    ) -> None:
        self.addresses = addresses
        self.dtype = dtype
        self.row_shape = row_shape
        self.width = width
        self.keep = keep

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.addresses), *self.row_shape)

    @property
    def nbytes(self) -> int:
        return len(self.addresses) * self.width

    def array(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.into(out)
        return out

    def into(self, out: np.ndarray) -> None:
        gather_rows(self.addresses, self.width, out)


class _Memory:
    """What ``np.asarray`` makes a view of: ``rows`` overlapping rows of ``width`` bytes, one
    starting at each byte from ``address`` (NOTE [ One gather across shards ])."""

    def __init__(self, address: int, rows: int, width: int) -> None:
        # (address, False): not read-only, or torch warns; nothing ever writes through it
        self.__array_interface__ = {
            "shape": (rows, width),
            "strides": (1, 1),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def gather_rows(addresses: np.ndarray, width: int, out: np.ndarray) -> None:
    """Copy ``width`` bytes from each of ``addresses`` (mapped rows, checked) into the rows of
    ``out`` (C-contiguous, ``len(addresses)`` rows of ``width`` bytes)."""
    if not len(addresses) or not width:
        return
    low = int(addresses.min())
    rows = int(addresses.max()) - low + 1
    memory = torch.from_numpy(np.asarray(_Memory(low, rows, width)))
    into = torch.from_numpy(out.reshape(len(addresses), -1).view(np.uint8))
    torch.index_select(memory, 0, torch.from_numpy(addresses - low), out=into)


def _fast_column(table: Any, number: int) -> tuple[np.dtype, tuple, int, int] | None:
    """(dtype, row shape, row bytes, address) of column ``number`` of ``table`` if its rows
    are one native-order C-contiguous array of the map; None if not."""
    column = table.columns[number]
    if not column.fixed or column.texts or table.segments != 1 or not table.count:
        return None
    rows = column.rows[0]
    if not rows.dtype.isnative or not rows.flags.c_contiguous or len(rows) != table.count:
        return None
    width = rows[:1].nbytes
    return rows.dtype, rows.shape[1:], width, rows.__array_interface__["data"][0]


class ShardMaps:
    """Per process: where each ready shard's fixed columns lie (NOTE [ One gather across
    shards ]). ``plan`` is the shards' ``(name, CHW image)`` per column."""

    def __init__(self, shards: int, plan: list[tuple[str, bool]]) -> None:
        self.plan = plan
        self.ready = np.zeros(shards, dtype=bool)
        self.tables: list[Any] = [None] * shards
        self.kinds: list[tuple | None] | None = None  # per column: (dtype, shape, width) or None
        self.bases = np.zeros((len(plan), shards), dtype=np.int64)

    def add(self, number: int, table: Any) -> bool:
        """Make shard ``number`` ready with its (fully checked) column ``table``; False where
        it stores a column otherwise than the first ready shard."""
        found = [_fast_column(table, column) for column in range(len(self.plan))]
        kinds = [None if item is None else item[:3] for item in found]
        if self.kinds is None:
            self.kinds = kinds
        if kinds != self.kinds or not any(kinds):
            return False
        for column, item in enumerate(found):
            if item is not None:
                self.bases[column, number] = item[3]
        self.tables[number] = table
        self.ready[number] = True
        return True

    def remove(self, number: int) -> None:
        """Shard ``number`` is closed in this process."""
        self.ready[number] = False
        self.tables[number] = None
        self.bases[:, number] = 0

    def fixed_columns(
        self, shards: np.ndarray, rows: np.ndarray, numbers: set[int]
    ) -> dict[int, Any]:
        """Each fixed column's rows of the batch (shard ``shards[i]``, row ``rows[i]``, all
        ready) as ``ScatteredRows``, or gathered and made CHW where the plan says."""
        assert self.kinds is not None
        keep = [self.tables[number] for number in numbers]
        out: dict[int, Any] = {}
        for column, kind in enumerate(self.kinds):
            if kind is None:
                continue
            dtype, shape, width = kind
            addresses = self.bases[column][shards] + rows * width
            value: Any = ScatteredRows(addresses, dtype, shape, width, keep)
            if self.plan[column][1]:
                value = np.ascontiguousarray(value.array().transpose(0, 3, 1, 2))
            out[column] = value
        return out
