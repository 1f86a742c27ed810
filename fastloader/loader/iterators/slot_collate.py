"""The loader's default collate stacking straight into a shared-memory slot.

Runs in the workers. Uses torch's collate machinery (``_utils.collate.collate`` with a
``collate_fn_map``; listed in NOTE [ torch internals fastloader relies on ]): every rule of
``default_collate`` is torch's own, except that a list of plain CPU tensors, or of plain
NumPy arrays, of one shape and dtype is left as a ``Stack`` for the transport to stack into
the slot, instead of into a new shared-memory segment (NOTE [ Batch transport ]). A batch that
does not collate is collated again by the loader's own default collate, for its error (which
names ragged fields: NOTE [ Naming ragged fields ]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from fastloader.datasets.collate import DEFAULT_COLLATES, PLAIN_KINDS, whole
from fastloader.datasets.collate import default_collate as fastloader_default_collate
from fastloader.datasets.columns import ColumnBatch
from fastloader.formats.mapped_rows import RowsToGather
from fastloader.loader.transport.send import Gather, Stack


def _stack_later(batch: Any, *, collate_fn_map: Any = None) -> Any:
    elem = batch[0]
    if type(elem) is torch.Tensor and elem.layout == torch.strided and not elem.is_nested:
        shape, dtype = elem.shape, elem.dtype
        plain = elem.device.type == "cpu"
        for tensor in batch:
            if not plain:
                break
            plain = (
                type(tensor) is torch.Tensor
                and tensor.shape == shape
                and tensor.dtype == dtype
                and not tensor.requires_grad
                and tensor.device.type == "cpu"
            )
        if plain:
            return Stack(list(batch))
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def _stack_arrays_later(batch: Any, *, collate_fn_map: Any = None) -> Any:
    elem = batch[0]
    dtype, shape = elem.dtype, elem.shape
    if dtype.kind in PLAIN_KINDS and dtype.isnative:
        for array in batch:  # (rows of one gather share one dtype object: ``is`` first)
            if type(array) is not np.ndarray or array.shape != shape:
                break
            if array.dtype is not dtype and array.dtype != dtype:
                break
        else:
            return Stack(list(batch), arrays=True)
    return default_collate_fn_map[np.ndarray](batch, collate_fn_map=collate_fn_map)


_MAP = {**default_collate_fn_map, torch.Tensor: _stack_later, np.ndarray: _stack_arrays_later}


def default_collate_into_slots(batch: Any) -> Any:
    """``default_collate(batch)``, its stacked tensors left as ``Stack`` placeholders."""
    try:
        if type(batch) is ColumnBatch:  # NOTE [ Batches read by columns ]
            return _collate_columns(batch)
        return collate(batch, collate_fn_map=_MAP)
    except (RuntimeError, TypeError):
        pass  # (outside the handler: its error alone, not chained to this one)
    if type(batch) is ColumnBatch:
        batch = batch.samples()
    return fastloader_default_collate(batch)  # its error, naming ragged fields


def _collate_columns(batch: ColumnBatch) -> dict[str, Any]:
    # a numeric column is the batch tensor: the transport copies it into the slot whole, and
    # gathers a mapped field's rows straight into it
    return {
        name: (Gather(column) if isinstance(column, RowsToGather) else torch.from_numpy(column))
        if whole(column)
        else collate(list(column), collate_fn_map=_MAP)
        for name, column in batch.columns.items()
    }


def into_slots(collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The collate function workers run before the transport: the default collate (torch's or
    fastloader's) stacks straight into the slot; a user's own runs as it is."""
    return default_collate_into_slots if collate_fn in DEFAULT_COLLATES else collate_fn
