"""One gather per column across the open shards of a sharded pack (NOTE [ One gather across
shards ])."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fastloader.formats.mapped_rows import PAGE, RowsToGather

__all__ = ["ColumnMemory", "ScatteredRows", "ShardMaps"]

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
# read like ``MappedRows``). The gather reads a view of the memory that spans the ready shards'
# rows (``ColumnMemory``, made again when shards come or go): NumPy's ``take`` of items of the
# largest unit that divides the row and every shard's offset (an LMDB shard's rows start 16
# bytes into a 4 KiB page: images of 12 KiB are 3 items), unbuffered into the destination as
# one pack's ``take`` is; where that unit would make a row more than 64 items (an HDF5 shard's
# offsets need not align), torch's ``index_select`` over a view with one "row" starting at every
# byte (strides (1, 1)), an index then a row's offset, each row copied whole. (In the main
# process, whose intra-op threads ``index_select`` spreads over, it took ~5x the time of
# NumPy's ``take`` on this busy 2-core box.) Only the rows of the batch are touched (the view
# also spans unrelated memory between the maps: never read, and nothing but this gather sees
# the view). Every address is of a row checked in range (the row is below the shard's count,
# which is the manifest's and its map's), in a map that stays mapped while the batch's
# ``ScatteredRows`` keeps the shards' column tables.
# A shard is ready once every block of it has been checked in this process (at its open: the
# same hashing the batches would do block by block, before any row is read) and when each
# column the batch takes by rows is one native-order segment (every LMDB shard under 256 MB,
# every HDF5 shard) stored as the first ready shard stores it; ragged and text columns are read
# per shard as before (sharded_columns.py), and a batch with a shard not ready goes that way.


class ScatteredRows(RowsToGather):
    """Rows of one fixed column of several shards, not yet copied: read as ``MappedRows``
    (``array()``, ``into(out)``). ``items`` indexes ``memory`` (``ColumnMemory``): each row's
    items, or each row's offset; ``keep`` holds the shards' maps (NOTE [ One gather across
    shards ])."""

    __slots__ = ("items", "memory", "dtype", "row_shape", "keep")

    def __init__(
        self, items: np.ndarray, memory: ColumnMemory, dtype: np.dtype, row_shape: tuple, keep: Any
    ) -> None:
        self.items = items
        self.memory = memory
        self.dtype = dtype
        self.row_shape = row_shape
        self.keep = keep

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.items), *self.row_shape)

    @property
    def nbytes(self) -> int:
        return len(self.items) * self.memory.width

    def array(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.into(out)
        return out

    def into(self, out: np.ndarray) -> None:
        self.memory.gather(self.items, out)

    def source_address(self) -> int | None:
        # rows lie whole units from the memory's start: one alignment when a unit is pages
        return self.memory.low if self.memory.unit % PAGE == 0 else None


class _Memory:
    """What ``np.asarray`` makes a view of: ``shape`` items of ``typestr`` from ``address``,
    ``strides`` apart (NOTE [ One gather across shards ])."""

    def __init__(self, address: int, shape: tuple, typestr: str, strides: tuple | None) -> None:
        # (address, False): not read-only, or torch warns; nothing ever writes through it
        self.__array_interface__ = {
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
            "data": (address, False),
            "version": 3,
        }


#: Most items a row is gathered in by NumPy (else torch gathers it whole, by its offset)
_ITEMS_PER_ROW = 64


class ColumnMemory:
    """The bytes ``[low, high)`` that hold the ready shards' rows of one fixed column (rows of
    ``width`` bytes at ``bases``), as what one gather of a batch's rows reads: items of ``unit``
    bytes (the largest that divides the row and every row's distance from ``low``) for NumPy's
    ``take``, or, where a row would be more than ``_ITEMS_PER_ROW`` items, overlapping rows
    one byte apart for torch's ``index_select`` (NOTE [ One gather across shards ]). Never
    read but at rows inside the maps."""

    def __init__(
        self, ready: np.ndarray, low: int, high: int, width: int, first: np.ndarray
    ) -> None:
        # first[s]: the byte offset from low of index 0 of shard s, so that index i of shard s
        # lies at first[s] + i * width (its ready entries: ``ready``)
        self.width, self.low = width, low
        unit = math.gcd(width, *(int(offset) for offset in np.unique(first[ready])))
        if width // unit <= _ITEMS_PER_ROW:
            self.unit, self.spread = unit, np.arange(width // unit, dtype=np.int64)
            self.items = np.asarray(_Memory(low, ((high - low) // unit,), f"|V{unit}", None))
        else:
            self.unit, self.spread = 1, None
            shape = (high - low - width + 1, width)
            self.items = torch.from_numpy(np.asarray(_Memory(low, shape, "|u1", (1, 1))))
        self.first, self.step = first // self.unit, width // self.unit

    def index(self, shards: np.ndarray, at: np.ndarray) -> np.ndarray:
        """What ``gather`` takes for indices ``at`` of shards ``shards`` (ready)."""
        items = self.first[shards] + at * self.step
        return items if self.spread is None else items[:, None] + self.spread

    def gather(self, index: np.ndarray, out: np.ndarray) -> None:
        """Copy the rows ``index`` names into ``out`` (C-contiguous, in order)."""
        if not len(index):
            return
        rows = out.reshape(len(index), -1).view(np.uint8)
        if self.spread is not None:
            into = rows.view(f"V{self.unit}")
            # "clip" is never used (the items are in range) but, unlike "raise", copies unbuffered
            np.take(self.items, index, axis=0, out=into, mode="clip")
        else:
            torch.index_select(self.items, 0, torch.from_numpy(index), out=torch.from_numpy(rows))


def _fast_column(table: Any, number: int) -> tuple[np.dtype, tuple, int, int] | None:
    """(dtype, row shape, row bytes, address) of column ``number`` of ``table`` if its rows
    are one native-order C-contiguous array of the map; None if not."""
    column = table.columns[number]
    if not column.fixed or column.texts or table.segments != 1 or not table.count:
        return None
    rows = column.rows[0]
    if not rows.dtype.isnative or not rows.flags.c_contiguous or len(rows) != table.count:
        return None
    if not rows[:1].nbytes:
        return None
    return rows.dtype, rows.shape[1:], rows[:1].nbytes, rows.__array_interface__["data"][0]


class ShardMaps:
    """Per process: where each ready shard's fixed columns lie (NOTE [ One gather across
    shards ]). ``plan`` is the shards' ``(name, CHW image)`` per column.

    ``ready`` has one entry more than there are shards, always False, so that a shard number
    of -1 or ``shards`` (an index out of range) is never ready."""

    def __init__(self, starts: np.ndarray, plan: list[tuple[str, bool]]) -> None:
        shards = len(starts) - 1
        self.starts = np.append(starts[:-1], 0)  # the first index of each shard (and a spare)
        self.plan = plan
        self.ready = np.zeros(shards + 1, dtype=bool)
        self.tables: list[Any] = [None] * shards
        self.kinds: list[tuple | None] | None = None  # per column: (dtype, shape, width) or None
        self.bases = np.zeros((len(plan), shards + 1), dtype=np.int64)
        self.ends = np.zeros(shards + 1, dtype=np.int64)  # rows per ready shard
        self._views: list[ColumnMemory | None] | None = None
        self._keep: tuple = ()

    def add(self, number: int, table: Any) -> bool:
        """Make shard ``number`` ready with its (fully checked) column ``table``; False where
        it stores a column otherwise than the first ready shard."""
        found = [_fast_column(table, column) for column in range(len(self.plan))]
        kinds = [None if item is None else item[:3] for item in found]
        if not any(kinds):  # nothing to gather (an empty shard says nothing of the others)
            return False
        if self.kinds is None:
            self.kinds = kinds
        if kinds != self.kinds:
            return False
        for column, item in enumerate(found):
            if item is not None:
                self.bases[column, number] = item[3]
        self.tables[number] = table
        self.ends[number] = table.count
        self.ready[number] = True
        self._views = None
        return True

    def remove(self, number: int) -> None:
        """Shard ``number`` is closed in this process."""
        if self.ready[number]:
            self.ready[number] = False
            self.tables[number] = None
            self._views = None

    def _made_views(self) -> list[ColumnMemory | None]:
        """Per fast column: the memory of every ready shard's rows (made again when shards
        come or go)."""
        assert self.kinds is not None
        ready = self.ready.copy()
        views: list[ColumnMemory | None] = []
        for column, kind in enumerate(self.kinds):
            if kind is None or not ready.any():
                views.append(None)
                continue
            width, bases = kind[2], self.bases[column]
            low = int(bases[ready].min())
            high = int((bases[ready] + self.ends[ready] * width).max())
            views.append(ColumnMemory(ready, low, high, width, bases - low - self.starts * width))
        self._keep = tuple(table for table in self.tables if table is not None)
        return views

    def fixed_columns(self, shards: np.ndarray, at: np.ndarray) -> dict[int, Any]:
        """Each fixed column's rows of indices ``at`` (of shards ``shards``, all ready, so in
        range) as ``ScatteredRows``, gathered and made CHW where the plan says."""
        assert self.kinds is not None
        views = self._views
        if views is None:
            views = self._views = self._made_views()
        out: dict[int, Any] = {}
        for column, kind in enumerate(self.kinds):
            memory = views[column]
            if kind is None or memory is None:
                continue
            value: Any = ScatteredRows(
                memory.index(shards, at), memory, kind[0], kind[1], self._keep
            )
            if self.plan[column][1]:
                value = np.ascontiguousarray(value.array().transpose(0, 3, 1, 2))
            out[column] = value
        return out
