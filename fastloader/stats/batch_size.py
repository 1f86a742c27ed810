"""How many samples a batch holds: the size of its first tensor, else of its first list.

Runs in the main process on every batch (``LoaderStats.record_batch``), so the common
``(images, labels)`` batch takes a fast path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from fastloader.datasets.collate import SCALAR_TYPES


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: its first tensor's (or array's) length, else its
    first list's.

    A 0-d tensor, or a batch with neither tensors nor lists, counts as one sample.
    """
    # Fast path for the common (images, labels) batch: this runs on every batch.
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if isinstance(first, torch.Tensor) and not first.is_nested:
        shape = first.shape
        return shape[0] if shape else 1
    size = _first_tensor_len(batch)
    if size is None:
        size = _first_list_len(batch)
    return 1 if size is None else size


def _first_tensor_len(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor) and batch.is_nested:
        return batch.size(0)  # a nested tensor has no .shape
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch.shape[0] if batch.ndim else 1
    for item in _children(batch):
        size = _first_tensor_len(item)
        if size is not None:
            return size
    return None


def _children(batch: Any) -> Iterable[Any]:
    """What ``_first_tensor_len`` looks into, in order: a container's items (none for a leaf)."""
    if isinstance(batch, (tuple, list)):
        # a list of numbers, strings: nothing to look into
        return (item for item in batch if type(item) not in SCALAR_TYPES)
    if isinstance(batch, Mapping):
        return batch.values()
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return (getattr(batch, field.name) for field in dataclasses.fields(batch))
    return ()


def _first_list_len(batch: Any) -> int | None:
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if isinstance(first, (tuple, list, Mapping)):
            return _first_list_len(first)
        return len(batch)
    if isinstance(batch, Mapping) and batch:
        return _first_list_len(next(iter(batch.values())))
    return None
