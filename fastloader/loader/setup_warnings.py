"""Warnings about a loader's set-up that would otherwise go unnoticed (each given once), and
the check of arguments that cannot take effect (NOTE [ Arguments that cannot take effect ]).

NOTE [ Empty epochs ]
An epoch that yields no batch at all is almost always a set-up mistake: ``drop_last=True``
with a ``batch_size`` larger than the data (or than one rank's share of it), an empty folder,
a sampler that yields nothing. torch iterates such an epoch silently, and a training loop then
"trains" for as many epochs as asked without a single step. The loader calls
``warn_if_empty_epoch`` when an epoch ends; it warns once per loader, naming the numbers and
the fix. An epoch resumed from a state taken at its very end is empty by design: not warned.

NOTE [ Arguments that cannot take effect ]
An argument that is silently ignored costs a user a training run: ``device_transform=Normalize``
without ``device=`` let uint8 batches reach the model, which failed much later. So at
construction each extra argument is checked against the others (torch's own arguments keep
torch's checks and timing). The audit, one line per argument:
- ``device_transform`` runs on the device's copy of each batch: without ``device`` -> ValueError
  (it would change the batches, so never ignored); not callable -> TypeError.
- ``device_prefetch`` counts batches copied ahead to ``device``: changed without ``device`` ->
  warning.
- ``pin_memory=True`` speeds up copies to an accelerator: with ``device="cpu"`` (batches stay
  in host memory) or with no accelerator present -> warning, once per loader here rather than
  torch's once per ``iter()``. ``device="cuda"`` pins by itself.
- ``shuffle`` on a ``Mix`` read in its own order: the Mix decides the order (its ``shuffle=``
  shuffles each source's epochs, its weights interleave them), so the loader's ``shuffle`` only
  picks, with ``distributed=True``, padding (training) or an exact split (evaluation); without
  ``distributed`` it does nothing -> warning.
- ``device`` (checked by ``fastloader.device.resolve_device``), ``device_prefetch``'s type and
  range, ``num_workers="auto"``, ``seed``, ``seed_rngs``, ``distributed`` (its sampler and
  process group): each has its own check where it is resolved; none of them can be ignored by
  another argument (``seed`` decides the order and every sample's seed even with
  ``seed_rngs="never"``).
Warnings here name the argument and what to do; Lightning rebuilding a loader from its
attributes passes the same arguments, so it gets the same verdict.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any


class IneffectiveArgumentWarning(UserWarning):
    """A DataLoader argument that cannot take effect with the others (see NOTE [ Arguments that
    cannot take effect ]); filter it with ``warnings.filterwarnings``."""


#: ``device_prefetch``'s default (the DataLoader's signature uses it too).
DEFAULT_DEVICE_PREFETCH = 2


def check_device_arguments(
    device_type: str | None,
    device_prefetch: int,
    device_transform: Any,
    pin_memory: bool,
    accelerator: bool,
) -> None:
    """Raise or warn for device arguments that cannot take effect (NOTE [ Arguments that cannot
    take effect ]).

    Args:
        device_type: the resolved ``device``'s type ("cpu", "cuda"), or None without one.
        device_prefetch: the loader's ``device_prefetch``.
        device_transform: the loader's ``device_transform``.
        pin_memory: the ``pin_memory`` the user passed.
        accelerator: whether this process has an accelerator to pin memory for.

    Raises:
        TypeError: ``device_transform`` is not callable.
        ValueError: ``device_transform`` without ``device``.
    """
    if device_transform is not None and not callable(device_transform):
        raise TypeError(f"device_transform must be callable, got {device_transform!r}")
    if device_transform is not None and device_type is None:
        raise ValueError(
            "device_transform= runs on the batches device= delivers, and device= is not set: "
            "pass device='cuda' (or 'cpu'), or apply the transform in the dataset or collate_fn"
        )
    if device_type is None and device_prefetch != DEFAULT_DEVICE_PREFETCH:
        _ineffective(
            f"device_prefetch={device_prefetch} has no effect without device=: nothing is "
            "copied ahead; pass device='cuda' or leave device_prefetch out"
        )
    if pin_memory and device_type == "cpu":
        _ineffective(
            "pin_memory=True has no effect with device='cpu' (batches stay in host memory) "
            "and costs a copy per batch: leave it out"
        )
    elif pin_memory and not accelerator:
        _ineffective(
            "pin_memory=True has no effect: this machine has no GPU (or other accelerator) to "
            "copy batches to; leave it out"
        )


def warn_if_shuffle_on_mix(shuffle: Any, distributed: bool, mix: Any) -> None:
    """Warn that ``shuffle`` does nothing on a Mix read in its own order without
    ``distributed`` (NOTE [ Arguments that cannot take effect ]); called by the DataLoader's
    constructor, just before the order is chosen."""
    if shuffle is None or distributed:
        return
    shuffles = mix.shuffle
    order = "shuffles each source's epochs" if shuffles else "reads each source in order"
    _ineffective(
        f"shuffle={shuffle!r} has no effect on a Mix: the Mix decides the order (this one "
        f"{order}, by its own shuffle=, and interleaves the sources by weight); leave the "
        "loader's shuffle out, and pass Mix(..., shuffle=...) to change it",
        stacklevel=4,
    )


def _ineffective(message: str, stacklevel: int = 4) -> None:
    warnings.warn(IneffectiveArgumentWarning(f"fastloader: {message}"), stacklevel=stacklevel)


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
