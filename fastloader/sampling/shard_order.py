"""The shard-aware order: a pure function of (seed, epoch, position) that reads shards, not samples.

NOTE [ The shard-aware order ]
A global shuffle makes every rank touch every shard in every window of time: with shards in an
object store, every node downloads the whole dataset each epoch. Shuffling only inside shards
makes batches of near neighbours. The order of epoch ``e`` over shards with sample counts
``c_0..c_{S-1}`` is, from ``(seed, e)`` alone:

1. the shards permuted; their samples concatenated in that order (a sequence of ``N``);
2. the sequence cut into ``lanes`` contiguous parts of ``N // lanes`` or one more samples (a
   lane holds about ``S / lanes`` consecutive shards of the permutation; a shard cut by a
   lane's end is split between two lanes);
3. inside each lane, its shards (pieces) grouped ``window`` at a time, and the samples of each
   group shuffled: a lane reads ``window`` shards at once, in random order within them;
4. the lanes interleaved: global position ``n`` is sample ``n // lanes`` of lane
   ``n % lanes``. Every global batch of ``G`` samples draws from ``lanes * window`` shards.

Positions are global, and the order does not depend on the world size, batch size or worker
count, so resume is exact as in NOTE [ Global order ] (sampling/distributed.py): step ``k``
takes positions ``[kG, (k+1)G)`` whatever the world. Only the *dealing* of a step's positions
to ranks differs from ``ElasticDistributedSampler``: a step's positions are sorted by lane
(stably) and cut into ``world_size`` parts of ``batch_size``, so rank ``r`` reads the lanes
``[r*lanes/W, (r+1)*lanes/W)`` and their shards only, when ``lanes`` is a multiple of the
world size and ``G`` of ``lanes`` (else a rank also reads a few samples of a neighbour's lane).
Per epoch the ranks of all nodes together fetch each shard about once. The working set of a
rank is ``window`` shards per lane it reads (plus what is downloaded ahead).
``lanes`` and ``window`` are part of the order: a state records them, and a resume with other
values is refused (``order.sampler``). docs/remote.md measures the shuffle against a global
one.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch

from fastloader.sampling.distributed import ElasticDistributedSampler
from fastloader.sampling.samplers import ints_of
from fastloader.sampling.seeds import epoch_seed

__all__ = ["DEFAULT_LANES", "DEFAULT_WINDOW", "ShardOrderSampler", "shard_epoch_order"]

DEFAULT_LANES = 8
DEFAULT_WINDOW = 4
_STREAM = 0x5AD0_0DE5  # this order's own stream of the epoch's seed
_CHUNK = 256  # positions handed out between two reports to the download-ahead


def _check_shape(lanes: Any, window: Any) -> tuple[int, int]:
    for name, value in (("lanes", lanes), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return lanes, window


def _lane_bounds(total: int, lanes: int) -> np.ndarray:
    base, extra = divmod(total, lanes)
    sizes = np.full(lanes, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def shard_epoch_order(
    seed: int, epoch: int, counts: Sequence[int], lanes: int, window: int
) -> np.ndarray:
    """The global order of one epoch (sample indices, shards' samples numbered in manifest
    order); see NOTE [ The shard-aware order ]."""
    lanes, window = _check_shape(lanes, window)
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rng = np.random.Generator(np.random.PCG64([epoch_seed(seed, epoch), _STREAM]))
    perm = rng.permutation(len(counts))
    shard_of = np.repeat(perm, counts[perm])  # step 1: the permuted shards' samples
    first = np.repeat(starts[perm], counts[perm])
    within = np.arange(total) - np.repeat(np.cumsum(counts[perm]) - counts[perm], counts[perm])
    sequence = first + within
    bounds = _lane_bounds(total, lanes)  # step 2
    lane_of = np.repeat(np.arange(lanes), np.diff(bounds))
    new_piece = np.ones(total, dtype=bool)
    new_piece[1:] = (shard_of[1:] != shard_of[:-1]) | (lane_of[1:] != lane_of[:-1])
    piece = np.cumsum(new_piece) - 1
    lane_first_piece = piece[np.minimum(bounds[:-1], total - 1)]
    group = (piece - lane_first_piece[lane_of]) // window  # step 3
    # sorted by lane, then group, then a random key: np.lexsort's order (a stable sort of each
    # key) in a quarter of its time. The random keys sorted by NumPy's fastest sort, which
    # gives a stable sort's order where no two keys are equal (else sorted stably); then the
    # (lane, group) pairs, as one small int when they fit 16 bits (a radix sort), stably.
    keys = rng.random(total)
    by_key = np.argsort(keys)
    ordered = keys[by_key]
    if (ordered[1:] == ordered[:-1]).any():
        by_key = np.argsort(keys, kind="stable")
    lane_group = lane_of * (int(group.max()) + 1) + group
    if int(lane_group[-1]) < 1 << 16:  # the largest: lanes and groups both ascend
        lane_group = lane_group.astype(np.uint16)
    shuffled = sequence[by_key[np.argsort(lane_group[by_key], kind="stable")]]
    position = np.arange(total)  # step 4
    return shuffled[bounds[position % lanes] + position // lanes]


def _warn_if_nodes_share_lanes(lanes: int, world: int) -> None:
    """Fewer lanes than nodes: each lane is read by several nodes, and each of them downloads
    its shards (docs/remote.md: 8 lanes on 64 nodes fetched 7x the data per node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world
    nodes = max(1, world // max(1, local))
    if lanes < nodes:
        warnings.warn(
            f"ShardOrderSampler: lanes={lanes} is below the {nodes} nodes, so nodes share "
            f"lanes and each downloads about {nodes / lanes:.0f}x its share of the shards; "
            "pass lanes= a multiple of the world size (docs/remote.md)",
            UserWarning,
            stacklevel=3,
        )


class ShardOrderSampler(ElasticDistributedSampler):
    """``ElasticDistributedSampler`` over the shard-aware order (NOTE [ The shard-aware order ]).

    Pass it as ``sampler=`` (with ``distributed=True`` or not); ``ShardedDataset.sampler()``
    makes one. Resume is exact on another world size, batch size or worker count.

    Args:
        dataset: a dataset with ``shard_counts`` (samples per shard, in manifest order).
        batch_size: samples per rank and step; must equal the loader's ``batch_size``.
        num_replicas, rank: the world size and this rank (default: from the process group).
        shuffle: the shard-aware order from ``(seed, epoch)``; else dataset order.
        seed: the loader's seed.
        drop_last: drop a short last global step.
        lanes, window: the order's shape (default: the dataset's ``lanes``/``window``, else
            8 and 4).
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
        lanes: int | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__(dataset, batch_size, num_replicas, rank, shuffle, seed, drop_last)
        self.lanes, self.window = _check_shape(
            lanes or getattr(dataset, "lanes", DEFAULT_LANES),
            window or getattr(dataset, "window", DEFAULT_WINDOW),
        )
        self.shard_counts = np.asarray(dataset.shard_counts, dtype=np.int64)  # type: ignore[attr-defined]
        _warn_if_nodes_share_lanes(self.lanes, self.num_replicas)

    @property
    def order_name(self) -> str:
        """What a loader's state records as the sampler (a resume must match it)."""
        if not self.shuffle:
            return "sequential"
        return f"shards lanes={self.lanes} window={self.window}"

    def global_order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_length)
        order = shard_epoch_order(self.seed, self.epoch, self.shard_counts, self.lanes, self.window)
        return torch.from_numpy(order)

    def _dealt(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``values`` as rows of one step each, each row sorted by its positions' lanes."""
        by_lane = torch.argsort(positions % self.lanes, dim=1, stable=True)
        return torch.gather(values, 1, by_lane)

    def _steps_dealt(self, steps: torch.Tensor, first: int) -> torch.Tensor:
        """``_dealt`` for whole steps from global position ``first`` on: a row's order by lane
        depends only on where its first position falls among the lanes, so it is computed
        once for each such place, not sorted row by row."""
        width = steps.shape[1]
        if width % self.lanes == 0 or len(steps) == 1:  # every row alike
            return steps[:, self._by_lane(first % self.lanes, width)]
        places = (first + torch.arange(len(steps)) * width) % self.lanes
        unique = places.unique().tolist()
        dealt = torch.empty_like(steps)
        for place in unique:
            rows = places == place
            dealt[rows] = steps[rows][:, self._by_lane(place, width)]
        return dealt

    def _by_lane(self, place: int, width: int) -> torch.Tensor:
        """The stable order by lane of ``width`` positions from one at lane ``place``."""
        return torch.argsort((place + torch.arange(width)) % self.lanes, stable=True)

    def rank_indices(self, start: int = 0) -> torch.Tensor:
        """This rank's indices from global position ``start`` on: each step dealt by lane."""
        order = self.global_order()
        rest = order[start:]
        positions = torch.arange(start, start + len(rest))
        full, short, pad = self._last_step(len(rest))
        cut = full * self.global_batch
        mine = []
        if full:
            steps = self._steps_dealt(rest[:cut].view(full, -1), start)
            mine.append(steps.view(full, self.num_replicas, self.batch_size)[:, self.rank, :])
        if short:
            last, where = rest[cut:], positions[cut:]
            if pad:
                last = torch.cat([last, order.repeat(pad // max(1, len(order)) + 1)[:pad]])
                where = torch.cat([where, torch.arange(pad)])
            last = self._dealt(last.view(1, -1), where.view(1, -1))[0]
            offset, size = self._part(short + pad, self.rank)
            mine.append(last[offset : offset + size])
        return torch.cat([m.reshape(-1) for m in mine]) if mine else order[:0]

    def iter_from(self, start: int) -> Iterator[int]:
        indices = self.rank_indices(start).numpy()
        plan = getattr(self.dataset, "plan_reads", None)
        if callable(plan):  # the shards this rank reads next, in order (download ahead)
            plan(indices)
        reading = getattr(self.dataset, "reading_at", None)
        if not callable(reading):
            return ints_of(indices)
        return itertools.chain.from_iterable(_chunks_told(indices, reading))


def _chunks_told(indices: np.ndarray, reading: Any) -> Iterator[list[int]]:
    """``indices`` as lists of ``_CHUNK`` ints (chained in C by the caller: no generator frame
    per index), telling ``reading`` the last position of each chunk as it is handed out: its
    shards are read now."""
    for at in range(0, len(indices), _CHUNK):
        chunk = indices[at : at + _CHUNK]
        reading(at + len(chunk) - 1)
        yield chunk.tolist()
