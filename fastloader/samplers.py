"""Samplers whose order is a function of (seed, epoch), so it can be known ahead and resumed.

NOTE [ A user's set_epoch wins ]

The DDP idiom calls ``sampler.set_epoch(epoch)`` before each epoch with the user's own counter
(which may start at 5 after a resume). fastloader also calls ``set_epoch`` itself: before every
epoch, and early, when it prefetches the next epoch. To tell the two apart, the loader replaces
a sampler's ``set_epoch`` on the instance with a ``RecordedSetEpoch`` that remembers the value of
the last call made from outside; the loader's own calls go through ``call_unrecorded``. The
next ``iter(loader)`` takes that value as its epoch (see ``DataLoader._next_epoch``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import RandomSampler

from fastloader.seeding import epoch_seed


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of ``n`` samples in ``epoch``: a permutation drawn from ``(seed, epoch)`` only.

    It is the order of ``shuffle=True`` and of ``distributed=True`` at any world size.
    """
    return torch.randperm(n, generator=epoch_generator(seed, epoch))


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A torch generator seeded from ``(seed, epoch)``: where every epoch's order is drawn."""
    generator = torch.Generator()
    generator.manual_seed(epoch_seed(seed, epoch))
    return generator


class EpochShuffleSampler(RandomSampler):
    """A ``RandomSampler`` whose permutation for epoch ``e`` is drawn from ``(seed, e)``.

    fastloader.DataLoader uses it for ``shuffle=True``. It is a RandomSampler, so code that
    checks for one (Lightning, when it injects a DistributedSampler) sees a shuffled loader.
    Without ``replacement`` or ``num_samples`` its order is ``epoch_permutation(seed, e, n)``.

    Args:
        data_source: the dataset (only its length is used).
        seed: the loader's seed.
        replacement: sample with replacement, as in RandomSampler.
        num_samples: number of samples per epoch, as in RandomSampler.
    """

    def __init__(
        self,
        data_source: Sized,
        seed: int,
        replacement: bool = False,
        num_samples: int | None = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` yield the order of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator = epoch_generator(self.seed, self.epoch)
        return super().__iter__()


class RecordedSetEpoch:
    """Stands in for a sampler's ``set_epoch``; see NOTE [ A user's set_epoch wins ].

    Calling it calls the sampler's own ``set_epoch`` and records the value as ``requested``.
    """

    def __init__(self, set_epoch: Any) -> None:
        self.call_unrecorded = set_epoch
        self.requested: int | None = None

    def __call__(self, epoch: int) -> Any:
        self.requested = epoch
        return self.call_unrecorded(epoch)


def record_set_epoch(sampler: Any) -> RecordedSetEpoch | None:
    """Install (or find) the ``RecordedSetEpoch`` of ``sampler``; None if it has no set_epoch."""
    current = getattr(sampler, "set_epoch", None)
    if isinstance(current, RecordedSetEpoch):
        return current
    if not callable(current):
        return None
    recorded = RecordedSetEpoch(current)
    try:
        sampler.set_epoch = recorded
    except (AttributeError, TypeError):  # __slots__ or a read-only attribute: cannot record
        return None
    return recorded


def samplers_with_set_epoch(loader: Any) -> list[Any]:
    """The loader's sampler, batch sampler and batch sampler's sampler that have set_epoch."""
    found: list[Any] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)) and all(sampler is not s for s in found):
            found.append(sampler)
    return found


def set_epoch_unrecorded(sampler: Any, epoch: int) -> None:
    """Call ``sampler.set_epoch(epoch)`` as the loader: not recorded as a user's request."""
    set_epoch = sampler.set_epoch
    getattr(set_epoch, "call_unrecorded", set_epoch)(epoch)
