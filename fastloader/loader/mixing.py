"""What the loader does for a ``Mix`` (main process): its sampler, its next unseen position,
re-planning after a weight change, its part of the state, and its realised proportions.

The mixed order itself is in ``fastloader/sampling/`` (NOTE [ The mixed order as a pure
function ] in mix_order.py); this module connects it to the loader's cursor (NOTE [ The epoch
cursor ] in loader/cursor.py) and iterators, so that dataloader.py only calls it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastloader.loader.resume import MIX_SAMPLERS
from fastloader.loader.setup_warnings import warn_if_shuffle_on_mix
from fastloader.sampling.mix import Mix, MixSample, mix_sampler
from fastloader.sampling.mix_samplers import ElasticMixSampler

__all__ = [
    "collate_for",
    "MIX_SAMPLERS",
    "choose_sampler",
    "count_sources",
    "next_position",
    "prepare_resume",
    "replan",
]


def choose_sampler(
    dataset: Any,
    sampler: Any,
    batch_sampler: Any,
    distributed: bool,
    shuffle: Any,
    batch_size: int | None,
    drop_last: bool,
    seed: int,
) -> tuple[Any, Any]:
    """(sampler, shuffle) for torch's constructor: a ``Mix`` without a sampler of the user's
    gets its own (``shuffle`` passed on: it only picks the padding rule when distributed)."""
    if not isinstance(dataset, Mix) or sampler is not None or batch_sampler is not None:
        return sampler, shuffle
    warn_if_shuffle_on_mix(shuffle, distributed, dataset.shuffle)  # its order wins
    if dataset.seed is None:
        dataset.use_seed(seed)
    return mix_sampler(dataset, distributed, shuffle, batch_size, drop_last), None


def _step(loader: Any) -> int:
    sampler = loader.sampler
    if isinstance(sampler, ElasticMixSampler):
        return sampler.global_batch
    return loader.batch_size or 1


def next_position(loader: Any) -> int:
    """The global position of the mixed stream that the training loop sees next.

    Raises:
        ValueError: in the middle of an epoch with ``device=``: batches already copied to
            the device ahead cannot be taken back.
    """
    cursor, length = loader._cursor, len(loader.dataset)
    if not cursor.started:
        epoch, position = cursor.epoch, cursor.target
    elif cursor.complete:
        epoch, position = cursor.epoch + 1, 0
    else:
        epoch, position = cursor.epoch, cursor.position(_step(loader), length)
        if loader._resolved_device is not None:
            raise ValueError(
                "cannot change a Mix's weights in the middle of an epoch with device=: batches "
                "are already on the device; change them between epochs or use a schedule"
            )
    return epoch * length + position


def replan(loader: Any) -> None:
    """Drop what was loaded ahead with the old weights; load again from the next unseen
    position (NOTE [ Weight changes ] in sampling/mix.py). Workers keep running."""
    cursor = loader._cursor
    live = loader.__dict__.get("_mix_iterator")
    iterator = live() if live is not None else None
    if cursor.started and not cursor.complete:
        epoch, position = cursor.epoch, cursor.position(_step(loader), len(loader.dataset))
    else:
        epoch, position = (cursor.epoch + 1 if cursor.started else cursor.epoch), 0
        iterator = loader._pool  # a persistent pool may have started the next epoch
        if iterator is None:
            return  # the next iteration draws its order afresh
    if iterator is None:
        return
    if hasattr(iterator, "begin_epoch"):
        iterator.begin_epoch(loader, epoch, position)  # in-flight batches are drained
    else:
        iterator._schedule.start(epoch, position)  # one process: only its look-ahead
    if cursor.started and not cursor.complete:
        cursor.restart_at(position)


def count_sources(loader: Any, source: Any, epoch: int, skip: int) -> None:
    """Called by ``iter(loader)``: remember the epoch's iterator (for ``replan``) and let the
    epoch's stats count the samples of each source delivered (computed when asked)."""
    loader.__dict__["_mix_iterator"] = weakref.ref(source)
    stats = loader.stats.current
    if stats is not None:
        stats.source_counts = functools.partial(
            _delivered, weakref.ref(loader), epoch, skip, _step(loader)
        )


def _delivered(loader_ref: Any, epoch: int, skip: int, step: int, stats: Any) -> dict | None:
    loader = loader_ref()
    if loader is None:
        return None
    length = len(loader.dataset)
    end = min(length, skip + stats.batches * step)
    return loader.dataset.realised(epoch * length + skip, epoch * length + end)


def prepare_resume(loader: Any, state: dict[str, Any]) -> Any:
    """Check a state's ``mix`` against the loader's dataset; return what applies it (or None).

    Raises:
        ValueError: a state of a Mix for another dataset, or the other way round, or a mix
            that cannot continue exactly (naming the field or source).
    """
    mix, saved = loader.dataset, state.get("mix")
    if not isinstance(mix, Mix):
        if saved is not None:
            raise ValueError("cannot resume: the state is of a Mix, this loader's dataset is not")
        return None
    if saved is None:
        if state.get("epoch_started") and not state.get("epoch_complete"):
            raise ValueError("cannot resume a Mix mid-epoch from a state without its mix")
        return None
    if state["epoch_started"] and not state["epoch_complete"]:
        epoch, position = state["epoch"], state["position"]
    else:
        epoch, position = state["epoch"] + bool(state["epoch_started"]), 0
    return mix.resume_from(saved, epoch, position)


def collate_for(dataset: Any, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The default collate for ``dataset``: ``collate``, or for a ``Mix`` one that makes the
    batch's ``MixSample`` fields quickly (``MixCollate``)."""
    return MixCollate(collate) if isinstance(dataset, Mix) else collate


class MixCollate:
    """Collates a batch of ``MixSample``s as torch's default collate does (the samples by
    ``collate``, the names as a tuple, the indices as an int64 tensor), the indices through
    NumPy: ``torch.tensor`` of a list of Python ints costs ~0.4 us an element, this ~0.02 us.
    Any other batch goes to ``collate`` whole."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, batch: Sequence[Any]) -> Any:
        if not batch or type(batch[0]) is not MixSample:
            return self.collate(batch)
        samples, sources, indices = zip(*batch, strict=True)
        index = torch.from_numpy(np.fromiter(indices, dtype=np.int64, count=len(indices)))
        return MixSample(self.collate(list(samples)), sources, index)
