"""Distributed sampling with one global order: elastic exact resume, exactly-once evaluation.

NOTE [ Global order ]

With ``distributed=True`` the order of epoch ``e`` is ``epoch_permutation(seed, e, N)`` (or
``0..N-1`` without shuffling), the same at every world size. Step ``k`` takes the global batch
``order[k*G : (k+1)*G]`` with ``G = batch_size * world_size``; rank ``r`` loads the slice
``[r*batch_size : (r+1)*batch_size]`` of it. A position in the epoch is a number of *global*
samples, the same on every rank, and the order from there on does not depend on the world size,
so a run resumes on another world size (or another global batch) with exactly the samples it had
not seen. Samples are still seeded from ``(seed, epoch, index)``, so a sample's augmentation
does not depend on the rank that loads it.

The last step may be short: ``R < G`` samples remain. Then:

- ``drop_last=True``: the step is dropped (every rank has the same number of full batches).
- ``shuffle=False, drop_last=False`` (evaluation): the ``R`` samples are split into contiguous,
  near-equal parts, rank ``r`` getting ``R // W`` or one more; no sample is repeated. When
  ``R < W``, ranks ``R..W-1`` have one batch fewer.
- ``shuffle=True, drop_last=False`` (training): split the same way, so every rank gets a last
  batch; only when ``R < W`` would some rank get none, and then the first ``W - R`` samples of
  the epoch's order are repeated once so every rank takes the same number of steps (DDP
  gradient synchronisation needs that). torch's DistributedSampler repeats up to ``W - 1``
  samples in every epoch for the same reason.

A resumed run applies these rules to what remains from its position, with its own world size
and batch size, so only the last step of the resumed epoch can differ from an uninterrupted run
(see README, "Elastic resume").
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from fastloader.sampling.samplers import epoch_permutation, ints_of

__all__ = ["ElasticDistributedSampler", "gather_in_order"]


class ElasticDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` over one global order; see NOTE [ Global order ].

    ``fastloader.DataLoader(distributed=True)`` makes one for you. It is a subclass of torch's
    ``DistributedSampler``, so Lightning keeps it instead of injecting its own.

    Args:
        dataset: the map-style dataset (only its length is used).
        batch_size: samples per rank and step; must equal the loader's ``batch_size``.
        num_replicas, rank: the world size and this rank (default: from the process group).
        shuffle: draw each epoch's order from ``(seed, epoch)``; else dataset order.
        seed: the loader's seed.
        drop_last: drop a short last global step instead of splitting it across ranks.

    Raises:
        ValueError: for a batch size below 1, or a rank outside ``[0, num_replicas)``.
        RuntimeError: without ``num_replicas``/``rank`` and no initialised process group.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.batch_size = batch_size
        self.dataset_length = len(dataset)
        self.num_samples = self.rank_length(0, self.rank)
        self.total_size = sum(self.rank_length(0, r) for r in range(self.num_replicas))

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks: ``batch_size * num_replicas``."""
        return self.batch_size * self.num_replicas

    def global_order(self) -> torch.Tensor:
        """The order of the whole dataset in the current epoch (independent of world size)."""
        if self.shuffle:
            return epoch_permutation(self.seed, self.epoch, self.dataset_length)
        return torch.arange(self.dataset_length)

    def _last_step(self, remaining: int) -> tuple[int, int, int]:
        """(full steps, samples in the short last step, samples repeated to pad it)."""
        full, short = divmod(remaining, self.global_batch)
        if self.drop_last or short == 0:
            return full, 0, 0
        pad = self.num_replicas - short if self.shuffle and short < self.num_replicas else 0
        return full, short, pad

    def _part(self, size: int, rank: int) -> tuple[int, int]:
        base, extra = divmod(size, self.num_replicas)
        return rank * base + min(rank, extra), base + (rank < extra)

    def rank_length(self, start: int, rank: int) -> int:
        """How many samples ``rank`` loads from global position ``start`` to the epoch's end."""
        full, short, pad = self._last_step(max(0, self.dataset_length - start))
        return full * self.batch_size + self._part(short + pad, rank)[1]

    def rank_indices(self, start: int = 0) -> torch.Tensor:
        """This rank's indices of the current epoch from global position ``start`` on."""
        order = self.global_order()
        rest = order[start:]
        full, short, pad = self._last_step(len(rest))
        steps = rest[: full * self.global_batch].view(full, self.num_replicas, self.batch_size)
        mine = [steps[:, self.rank, :].reshape(-1)]
        if short:
            last = rest[full * self.global_batch :]
            if pad:
                last = torch.cat([last, order.repeat(pad // max(1, len(order)) + 1)[:pad]])
            offset, size = self._part(short + pad, self.rank)
            mine.append(last[offset : offset + size])
        return torch.cat(mine)

    def iter_from(self, start: int) -> Iterator[int]:
        """This rank's indices of the current epoch from global position ``start`` on."""
        return ints_of(self.rank_indices(start).numpy())

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def __len__(self) -> int:
        return self.num_samples


def gather_in_order(
    indices: Any, results: Any, *, length: int | None = None, group: Any = None
) -> list[Any]:
    """Every rank's per-sample results, in dataset order (for exactly-once evaluation).

    Each rank passes the dataset indices it evaluated and one result per index; every rank
    gets back all results ordered by index. Call it on every rank (it is a collective:
    ``torch.distributed.all_gather_object``), once, after the evaluation loop. Without an
    initialised process group it only sorts this process's results.

    Args:
        indices: the dataset indices this rank evaluated (ints or an int tensor).
        results: one picklable result per index (a list, or a tensor whose first dimension
            is per sample).
        length: if given, check that every index ``0..length-1`` arrived exactly once.
        group: the process group (default: the whole world).

    Raises:
        ValueError: when indices and results differ in length, an index arrived twice (the
            loader repeated a sample), or, with ``length``, an index is missing.
    """
    if isinstance(indices, torch.Tensor):
        indices = indices.tolist()
    indices = [int(i) for i in indices]
    results = list(results)
    if len(indices) != len(results):
        raise ValueError(f"got {len(indices)} indices but {len(results)} results")
    pairs = list(zip(indices, results, strict=True))
    if dist.is_available() and dist.is_initialized():
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, pairs, group=group)
    else:
        parts = [pairs]
    merged: dict[int, Any] = {}
    for part in parts:
        for index, result in part:
            if index in merged:
                raise ValueError(
                    f"sample {index} was evaluated twice: use DataLoader(distributed=True, "
                    "shuffle=False, drop_last=False), which gives each sample to one rank"
                )
            merged[index] = result
    if length is not None:
        missing = sorted(set(range(length)) - merged.keys())
        if missing or len(merged) != length:
            shown = ", ".join(map(str, missing[:10])) or "indices out of range"
            raise ValueError(f"{len(missing)} of {length} samples have no result: {shown}")
    return [merged[index] for index in sorted(merged)]
