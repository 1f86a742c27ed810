"""The samplers of a ``Mix``: the global mixed order, cut into epochs and across ranks.

Run in the main process; they hand the loader one code per sample (NOTE [ The mixed order as
a pure function ] in mix_order.py), computed a block at a time, never the whole epoch at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from fastloader.sampling.distributed import ElasticDistributedSampler

__all__ = ["ElasticMixSampler", "MixSampler"]

_BLOCK = 8192  # positions mapped to codes at a time


def _codes(mix: Any, positions: np.ndarray) -> Iterator[int]:
    for at in range(0, len(positions), _BLOCK):
        yield from mix.order.indices(positions[at : at + _BLOCK])[2].tolist()


class MixSampler(Sampler[int]):
    """The order of a ``Mix`` in one process: epoch ``e`` is global positions
    ``[e * L, (e + 1) * L)`` of the mixed order, ``L = len(mix)``.

    ``fastloader.DataLoader`` makes one for a ``Mix`` (``shuffle`` does not apply: the mix is
    shuffled within each source, see ``Mix``). With torch's own DataLoader, pass it as
    ``sampler=`` and call ``set_epoch`` each epoch.

    Args:
        mix: the ``Mix``.
    """

    def __init__(self, mix: Any) -> None:
        self.mix = mix
        self.epoch = 0

    @property
    def seed(self) -> int:
        """The mix's seed (the order's)."""
        return self.mix.order.seed

    def __len__(self) -> int:
        return len(self.mix)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` yield the order of ``epoch``."""
        self.epoch = epoch

    def iter_from(self, start: int) -> Iterator[int]:
        """This epoch's codes from position ``start`` of the epoch on (exact resume)."""
        length = len(self.mix)
        base = self.epoch * length
        return _codes(self.mix, np.arange(base + start, base + length, dtype=np.int64))

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)


class ElasticMixSampler(ElasticDistributedSampler):
    """An ``ElasticDistributedSampler`` over the global order of a ``Mix``.

    Step ``k`` of epoch ``e`` takes global positions ``e * L + start + k * G ...`` (``G`` the
    global batch) and rank ``r`` its ``batch_size`` of them, as NOTE [ Global order ] in
    distributed.py describes; the positions are mapped to samples by the mix. With
    ``shuffle=False`` (evaluation) a short last step is split without repeats, with
    ``shuffle=True`` (training) it is padded from the epoch's start when it has fewer samples
    than ranks. ``fastloader.DataLoader(mix, distributed=True)`` makes one.

    Args:
        mix: the ``Mix``.
        batch_size: samples per rank and step.
        num_replicas, rank: the world size and this rank (default: from the process group).
        shuffle: training (pad a short last step) or evaluation (no repeats).
        drop_last: drop a short last global step.
    """

    def __init__(
        self,
        mix: Any,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            mix,
            batch_size,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=mix.order.seed,
            drop_last=drop_last,
        )
        self.mix = mix

    def _positions(self, start: int) -> Iterator[np.ndarray]:
        """This rank's positions in the epoch (from ``start``), a block of steps at a time."""
        length = self.dataset_length
        full, short, pad = self._last_step(max(0, length - start))
        width, rank_at = self.global_batch, self.rank * self.batch_size
        lane = np.arange(self.batch_size, dtype=np.int64)
        per_block = max(1, _BLOCK // self.batch_size)
        for first in range(0, full, per_block):
            steps = np.arange(first, min(full, first + per_block), dtype=np.int64)
            yield (start + steps[:, None] * width + rank_at + lane[None, :]).ravel()
        if short:
            last = np.arange(start + full * width, length, dtype=np.int64)
            if pad:  # the first `pad` samples of the epoch's order, as ElasticDistributedSampler
                last = np.concatenate([last, np.arange(pad, dtype=np.int64) % max(1, length)])
            offset, size = self._part(short + pad, self.rank)
            yield last[offset : offset + size]

    def iter_from(self, start: int) -> Iterator[int]:
        """This rank's codes of the current epoch from global position ``start`` on."""
        base = self.epoch * self.dataset_length
        for positions in self._positions(start):
            yield from _codes(self.mix, positions + base)

    def rank_indices(self, start: int = 0) -> torch.Tensor:
        """This rank's codes of the current epoch from global position ``start`` on."""
        return torch.tensor(list(self.iter_from(start)), dtype=torch.int64)

    def global_order(self) -> torch.Tensor:
        """The codes of the whole epoch, in the global order (materialised: for tests)."""
        length = self.dataset_length
        base = self.epoch * length
        return torch.tensor(
            list(_codes(self.mix, np.arange(base, base + length, dtype=np.int64))),
            dtype=torch.int64,
        )
