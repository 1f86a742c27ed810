"""Warnings about a loader's set-up that would otherwise go unnoticed (each given once).

NOTE [ Empty epochs ]
An epoch that yields no batch at all is almost always a set-up mistake: ``drop_last=True``
with a ``batch_size`` larger than the data (or than one rank's share of it), an empty folder,
a sampler that yields nothing. torch iterates such an epoch silently, and a training loop then
"trains" for as many epochs as asked without a single step. The loader calls
``warn_if_empty_epoch`` when an epoch ends; it warns once per loader, naming the numbers and
the fix. An epoch resumed from a state taken at its very end is empty by design: not warned.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any


class EmptyEpochWarning(UserWarning):
    """An epoch yielded no batch (filter it with ``warnings.filterwarnings``)."""


_warned: weakref.WeakSet = weakref.WeakSet()


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def empty_epoch_message(loader: Any) -> str:
    """Why ``loader``'s epoch is empty, and what to change, in one line."""
    samples = _length(loader.dataset)
    sampler = getattr(loader, "sampler", None)
    batch_size, drop_last = getattr(loader, "batch_size", None), getattr(loader, "drop_last", False)
    per_rank = _length(sampler) if sampler is not None else None
    world = getattr(sampler, "num_replicas", None)
    if samples is None:
        return "an epoch yielded no batch: the iterable dataset yielded no sample"
    if samples == 0:
        return "an epoch yielded no batch: the dataset is empty (len(dataset) == 0)"
    if drop_last and batch_size and per_rank is not None and per_rank < batch_size:
        share = (
            ""
            if per_rank == samples
            else f" ({per_rank} per rank over {world} ranks)"
            if world and world > 1
            else f" ({per_rank} in the sampler's epoch)"
        )
        return (
            f"an epoch yielded no batch: the dataset has {samples} samples{share}, fewer "
            f"than batch_size={batch_size}, and drop_last=True drops the short batch; lower "
            "batch_size or set drop_last=False"
        )
    if per_rank == 0:
        return "an epoch yielded no batch: the sampler yielded no index"
    return f"an epoch yielded no batch ({samples} samples, batch_size={batch_size})"


def warn_if_empty_epoch(loader: Any, num_batches: int, resumed_at_end: bool = False) -> bool:
    """Warn once per loader when an epoch ended with ``num_batches == 0``.

    See NOTE [ Empty epochs ].

    Args:
        loader: the DataLoader whose epoch just ended.
        num_batches: how many batches that epoch yielded.
        resumed_at_end: the epoch was resumed from a state at its end (empty by design).

    Returns:
        Whether a warning was given.
    """
    if num_batches or resumed_at_end or loader in _warned:
        return False
    _warned.add(loader)
    warnings.warn(EmptyEpochWarning(f"fastloader: {empty_epoch_message(loader)}"), stacklevel=3)
    return True
