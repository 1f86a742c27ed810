"""A batch of a sharded pack read by columns: each shard's rows from its column table, put
together in the batch's order (NOTE [ A sharded batch read by columns ])."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fastloader.datasets.columns import ColumnBatch
from fastloader.datasets.field_samples import _plan_columns
from fastloader.formats.mapped_rows import MappedRows, gathered

__all__ = ["column_plan", "read_columns_by_shard", "read_shard_columns"]

# NOTE [ A sharded batch read by columns ]
# A shuffled batch of 64 reads from up to lanes x window (32) shards. Read sample by sample
# (``getitems_with``: each decoded into a dict, then stacked by the collate) it cost ~6x one
# pack's batch read by columns, so where no code of the user's runs per sample the batch is
# read by columns, as one pack's is (``read_columns`` in field_samples.py: the same plan, each
# block's checksum verified once per process). Where every shard of the batch is open and
# checked in this process, each fixed column is one gather across the shards (NOTE [ One
# gather across shards ] in shard_gather.py); this module is the path for the rest: a batch
# with a shard not ready yet (its first batches, a shard with a damaged block), and ragged and
# text columns. The rows are grouped by shard in one pass of plain Python, checked in range
# once for the batch, and each shard gives its column table's rows; each fixed column is then
# copied row by row from the shards' maps into one array in the batch's order; a ragged or
# text field is a list. The batch equals ``default_collate`` of the samples. A column stored
# fixed in one shard and ragged in another (a ragged field whose values in one shard share a
# shape), or whose shards disagree in shape or dtype, is merged as the list of its rows, which
# the collate treats as the samples' values.


def column_plan(pack: Any) -> tuple[list[tuple[str, bool]], Any] | None:
    """A shard's fields as read by columns (name, CHW image) and its column table (for as long
    as the shard is open in this process), or None where its samples need per-sample work: the
    plan ``read_columns`` makes for one pack."""
    read = getattr(pack, "read_batch_columns", None)
    if not callable(read) or not len(pack) or read([0]) is None:  # the pack's own answer
        return None
    return _plan_columns(pack), pack.column_table()


def read_shard_columns(
    groups: list[tuple[Any, bool, list[int], list[int]]], plan: list[tuple[str, bool]], length: int
) -> ColumnBatch:
    """The batch from ``(column table, verify checksums, rows, their batch positions)`` per
    shard, read as ``plan`` says (NOTE [ A sharded batch read by columns ])."""
    columns = read_columns_by_shard(groups, plan, length, range(len(plan)))
    return ColumnBatch({name: columns[number] for number, (name, _) in enumerate(plan)}, length)


def read_columns_by_shard(
    groups: list[tuple[Any, bool, list[int], list[int]]],
    plan: list[tuple[str, bool]],
    length: int,
    numbers: Iterable[int],
) -> dict[int, Any]:
    """Columns ``numbers`` of the batch, each shard's rows read from its column table and put
    in the batch's order (``read_shard_columns``)."""
    numbers = list(numbers)
    pieces = []
    for table, verify, rows, slots in groups:
        at = np.array(rows, dtype=np.int64)
        if verify:
            table.check_rows(at)
        pieces.append((slots, {number: table.batch(number, at) for number in numbers}))
    batch = {}
    for number in numbers:
        column = _merged([(slots, columns[number]) for slots, columns in pieces], length)
        if plan[number][1]:
            column = np.ascontiguousarray(column.transpose(0, 3, 1, 2))
        batch[number] = column
    return batch


def _merged(pieces: list[tuple[list[int], Any]], length: int) -> Any:
    first = pieces[0][1]
    if not isinstance(first, list):
        shape, dtype = first.shape[1:], first.dtype
        if all(
            not isinstance(piece, list) and piece.shape[1:] == shape and piece.dtype == dtype
            for _, piece in pieces
        ):
            out = np.empty((length, *shape), dtype=dtype)
            for slots, piece in pieces:
                _copy_rows(out, slots, piece)
            return out
    values: list[Any] = [None] * length
    for slots, piece in pieces:
        for slot, value in zip(slots, list(gathered(piece)), strict=True):
            values[slot] = value
    return values


def _copy_rows(out: np.ndarray, slots: list[int], piece: Any) -> None:
    """``out[slots] = piece``'s rows, from a shard's map straight into ``out``."""
    if type(piece) is not MappedRows:
        out[slots] = piece
        return
    source, rows = piece.source, piece.rows.tolist()
    if not source.flags.c_contiguous or not out.flags.c_contiguous:
        for slot, row in zip(slots, rows, strict=True):
            out[slot] = source[row]
        return
    # a row's bytes copied as bytes: a third of the time of a NumPy row assignment
    width = out[0].nbytes if len(out) else 0
    into, source_bytes = memoryview(out).cast("B"), memoryview(source).cast("B")
    for slot, row in zip(slots, rows, strict=True):
        into[slot * width : (slot + 1) * width] = source_bytes[row * width : (row + 1) * width]
