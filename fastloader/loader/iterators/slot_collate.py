"""torch's ``default_collate`` stacking straight into a shared-memory slot.

Runs in the workers. Uses torch's collate machinery (``_utils.collate.collate`` with a
``collate_fn_map``; listed in NOTE [ torch internals fastloader relies on ]): every rule of
``default_collate`` is torch's own, except that a list of equal plain CPU tensors (NumPy
arrays become tensors first, as in torch) is left as a ``Stack`` for the transport to stack
into the slot, instead of into a new shared-memory segment (NOTE [ Batch transport ]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from fastloader.loader.transport.send import Stack


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


_MAP = {**default_collate_fn_map, torch.Tensor: _stack_later}


def default_collate_into_slots(batch: Any) -> Any:
    """``default_collate(batch)``, its stacked tensors left as ``Stack`` placeholders."""
    return collate(batch, collate_fn_map=_MAP)
