"""Samplers whose order is a function of (seed, epoch), so it can be known ahead and resumed."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import RandomSampler

from fastloader.seeding import epoch_seed


class EpochShuffleSampler(RandomSampler):
    """A ``RandomSampler`` whose permutation for epoch ``e`` is drawn from ``(seed, e)``.

    fastloader.DataLoader uses it for ``shuffle=True``. It is a RandomSampler, so code that
    checks for one (Lightning, when it injects a DistributedSampler) sees a shuffled loader.

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
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(self.seed, self.epoch))
        self.generator = generator
        return super().__iter__()
