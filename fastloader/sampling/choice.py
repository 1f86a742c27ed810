"""Which sampler a loader reads its dataset with: the one place the order is chosen.

NOTE [ Choosing the order ]

``fastloader.DataLoader`` hands its ``sampler``, ``batch_sampler``, ``shuffle`` and
``distributed`` arguments to ``choose_sampler`` and passes what it returns to torch's
constructor. The rules, in order:

1. A sampler or batch sampler of the user's is kept (with ``distributed=True`` it must be a
   ``DistributedSampler``; an ``ElasticDistributedSampler`` must split the loader's
   ``batch_size``).
2. A dataset that brings its own order gives its sampler (``OwnOrder``: a ``Mix``, whose order
   is the mixed one, NOTE [ The mixed order as a pure function ] in mix_order.py); ``shuffle``
   goes to it (for a ``Mix`` it only picks the padding rule with ``distributed=True``) and not
   to torch.
3. ``shuffle=True`` over a dataset of shards (``ShardedDataset``: it has ``shard_counts``):
   ``ShardOrderSampler``, the shard-aware order (NOTE [ The shard-aware order ] in
   shard_order.py), with or without ``distributed=True``.
4. ``distributed=True``: ``ElasticDistributedSampler``, one global order cut across ranks
   (NOTE [ Global order ] in distributed.py).
5. ``shuffle=True`` over a map-style dataset: ``EpochShuffleSampler``, each epoch's order drawn
   from ``(seed, epoch)``.
6. Anything else is torch's choice (``SequentialSampler``, or what torch does with an iterable
   dataset).

A new kind of dataset with an order of its own implements ``OwnOrder``; nothing here or in the
loader names it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset, Sampler

from fastloader.sampling.distributed import ElasticDistributedSampler
from fastloader.sampling.samplers import EpochShuffleSampler
from fastloader.sampling.shard_order import ShardOrderSampler

__all__ = ["OwnOrder", "choose_sampler"]


@runtime_checkable
class OwnOrder(Protocol):
    """A dataset that brings its own order (a ``Mix``): the loader reads it with this sampler
    unless the user passed a sampler or batch sampler (NOTE [ Choosing the order ])."""

    def loader_sampler(
        self,
        *,
        distributed: bool,
        shuffle: Any,
        batch_size: int | None,
        drop_last: bool,
        seed: int,
    ) -> Sampler:
        """The sampler for a loader with these arguments (``seed``: the loader's)."""
        ...


def choose_sampler(
    dataset: Any,
    sampler: Any,
    batch_sampler: Any,
    *,
    shuffle: Any,
    distributed: bool,
    batch_size: int | None,
    drop_last: bool,
    seed: int,
) -> tuple[Any, Any]:
    """The ``(sampler, shuffle)`` to give torch's DataLoader (NOTE [ Choosing the order ]).

    Raises:
        ValueError: with ``distributed=True``, for a sampler that is no ``DistributedSampler``,
            a batch sampler, an iterable dataset, or an ``ElasticDistributedSampler`` of
            another batch size.
        RuntimeError: with ``distributed=True``, without an initialised process group.
    """
    if sampler is None and batch_sampler is None and isinstance(dataset, OwnOrder):
        sampler = dataset.loader_sampler(
            distributed=distributed,
            shuffle=shuffle,
            batch_size=batch_size,
            drop_last=drop_last,
            seed=seed,
        )
        shuffle = None
    if sampler is None and batch_sampler is None and shuffle and _sharded(dataset):
        world = {} if distributed else {"num_replicas": 1, "rank": 0}
        sampler = ShardOrderSampler(
            dataset, batch_size or 1, seed=seed, drop_last=drop_last, **world
        )
        shuffle = None
    if distributed:
        sampler = _distributed_sampler(
            dataset, shuffle, sampler, batch_sampler, seed, drop_last, batch_size
        )
        return sampler, None
    map_style = not isinstance(dataset, IterableDataset)
    if shuffle and map_style and sampler is None and batch_sampler is None:
        return EpochShuffleSampler(dataset, seed), None
    return sampler, shuffle


def _sharded(dataset: Any) -> bool:
    """A dataset of shards (``ShardedDataset``: it tells its shards' sample counts)."""
    return getattr(dataset, "shard_counts", None) is not None


def _distributed_sampler(
    dataset: Any,
    shuffle: Any,
    sampler: Any,
    batch_sampler: Any,
    seed: int,
    drop_last: bool,
    batch_size: int | None,
) -> DistributedSampler:
    if isinstance(sampler, ElasticDistributedSampler):
        if sampler.batch_size != (batch_size or 1):
            raise ValueError(
                f"the ElasticDistributedSampler splits global batches of batch_size "
                f"{sampler.batch_size} per rank, but the loader's batch_size is {batch_size}"
            )
        return sampler
    if isinstance(sampler, DistributedSampler):
        return sampler
    if sampler is not None or batch_sampler is not None:
        raise ValueError("distributed=True chooses the sampler: do not pass sampler/batch_sampler")
    if isinstance(dataset, IterableDataset):
        raise ValueError("distributed=True needs a map-style dataset, got an IterableDataset")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "distributed=True needs an initialised torch.distributed process group "
            "(call torch.distributed.init_process_group first, or run under torchrun)"
        )
    return ElasticDistributedSampler(
        dataset, batch_size or 1, shuffle=bool(shuffle), seed=seed, drop_last=drop_last
    )
