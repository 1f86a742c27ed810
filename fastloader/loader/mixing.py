"""What the loader adds for a ``Mix`` (main process): its collate, its part of a resume, the
samples of each source delivered, and the (source, index) of a batch's samples.

The mixed order itself is in ``fastloader/sampling/`` (NOTE [ The mixed order as a pure
function ] in mix_order.py), and a Mix gives the loader its sampler through ``OwnOrder``
(NOTE [ Choosing the order ] in sampling/choice.py). Where the loader is, and re-loading after
a weight change, are the loader's own (``DataLoader._mix_next_position``, ``_mix_replan``, over
NOTE [ The epoch cursor ]): the functions here are handed what they need.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastloader.loader.resume import MIX_SAMPLERS
from fastloader.loader.seeding import collate_draws_nothing
from fastloader.sampling.mix import Mix, MixSample
from fastloader.sampling.mix_samplers import ElasticMixSampler

__all__ = [
    "MIX_SAMPLERS",
    "MixCollate",
    "collate_for",
    "mix_step",
    "prepare_resume",
    "readable_indices",
    "source_counter",
    "source_indices",
]


def mix_step(sampler: Any, batch_size: int | None) -> int:
    """Global positions of the mixed order a loader with ``sampler`` takes per batch."""
    if isinstance(sampler, ElasticMixSampler):
        return sampler.global_batch
    return batch_size or 1


def source_counter(loader: Any, epoch: int, skip: int) -> Callable[[Any], dict | None]:
    """What an epoch's stats call to count the samples of each source delivered (computed when
    asked; the loader is held weakly)."""
    step = mix_step(loader.sampler, loader.batch_size)
    return functools.partial(_delivered, weakref.ref(loader), epoch, skip, step)


def _delivered(loader_ref: Any, epoch: int, skip: int, step: int, stats: Any) -> dict | None:
    loader = loader_ref()
    if loader is None:
        return None
    length = len(loader.dataset)
    end = min(length, skip + stats.batches * step)
    return loader.dataset.realised(epoch * length + skip, epoch * length + end)


def source_indices(mix: Mix, codes: Any) -> Any:
    """``(source name, index in that source)`` of each code of a Mix's sampler (a list for a
    batch of codes, one pair for one code): what ``loader.last_indices`` holds for a Mix, the
    ``source`` and ``index`` of its ``MixSample``s."""
    order = mix.order
    single = np.ndim(codes) == 0
    rest = np.asarray([codes] if single else codes, dtype=np.int64) % order.total
    # a source removed on a reweighted resume has size 0: side="right" passes over it
    source = np.searchsorted(order.offsets, rest, side="right") - 1
    index = rest - order.offsets[source]
    pairs = [(order.names[s], i) for s, i in zip(source.tolist(), index.tolist(), strict=True)]
    return pairs[0] if single else pairs


def readable_indices(dataset: Any, indices: Any) -> Any:
    """A batch's indices as ``loader.last_indices`` gives them: a copy of the sampler's list
    (or its one index), for a ``Mix`` its ``(source, index)`` pairs (``source_indices``)."""
    if isinstance(dataset, Mix):
        return source_indices(dataset, indices)
    return list(indices) if isinstance(indices, list) else indices


def prepare_resume(dataset: Any, state: dict[str, Any]) -> Any:
    """Check a state's ``mix`` against the loader's dataset; return what applies it (or None).

    Raises:
        ValueError: a state of a Mix for another dataset, or the other way round, or a mix
            that cannot continue exactly (naming the field or source).
    """
    saved = state.get("mix")
    if not isinstance(dataset, Mix):
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
    return dataset.resume_from(saved, epoch, position)


def collate_for(dataset: Any, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The default collate for ``dataset``: ``collate``, or for a ``Mix`` one that makes the
    batch's ``MixSample`` fields quickly (``MixCollate``)."""
    return MixCollate(collate) if isinstance(dataset, Mix) else collate


class MixCollate:
    """Collates a batch of ``MixSample``s as torch's default collate does (the samples by
    ``collate``, the names as a tuple, the indices as an int64 tensor), the indices through
    NumPy: ``torch.tensor`` of a list of Python ints costs ~0.4 us an element, this ~0.02 us.
    Any other batch goes to ``collate`` whole.

    It draws no random numbers when ``collate`` draws none (``draws_nothing``, see
    ``collate_draws_nothing``): then a Mix's batches are seeded as the default collate's are
    and may travel several to a message (NOTE [ Batches per message ]).
    """

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate
        self.draws_nothing = collate_draws_nothing(collate)

    def __call__(self, batch: Sequence[Any]) -> Any:
        if not batch or type(batch[0]) is not MixSample:
            return self.collate(batch)
        samples, sources, indices = zip(*batch, strict=True)
        index = torch.from_numpy(np.fromiter(indices, dtype=np.int64, count=len(indices)))
        return MixSample(self.collate(list(samples)), sources, index)
