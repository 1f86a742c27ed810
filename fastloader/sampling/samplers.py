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

import itertools
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import RandomSampler, Sampler

from fastloader.sampling.seeds import epoch_seed

_CHUNK = 1 << 16  # indices turned into Python ints at a time


def ints_of(order: np.ndarray, start: int = 0) -> Iterator[int]:
    """The ints of ``order[start:]``, converted a chunk at a time (NOTE [ Compact epoch order ]).
    Chained in C: no generator frame per index."""
    return itertools.chain.from_iterable(_chunks(order, start))


def _chunks(order: np.ndarray, start: int) -> Iterator[list[int]]:
    for at in range(start, len(order), _CHUNK):
        yield order[at : at + _CHUNK].tolist()


def compact_permutation(n: int, generator: torch.Generator) -> np.ndarray:
    """``torch.randperm(n, generator=generator)`` as a NumPy array, int32 where ``n`` fits.

    The same permutation as the int64 one: torch's CPU randperm draws the same numbers for
    either dtype (checked in tests/test_bigger_than_memory.py).
    """
    dtype = torch.int32 if n < 2**31 else torch.int64
    return torch.randperm(n, generator=generator, dtype=dtype).numpy()


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of ``n`` samples in ``epoch``: a permutation drawn from ``(seed, epoch)`` only.

    It is the order of ``shuffle=True`` and of ``distributed=True`` at any world size.
    """
    return torch.randperm(n, generator=epoch_generator(seed, epoch))


def checked_seed(seed: Any) -> int:
    """``seed`` as an int, checked when a sampler is built rather than when it is iterated.

    Raises:
        TypeError: for anything but an int (NumPy integers included; not bool).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
    return int(seed)


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

    Raises:
        TypeError: for a ``seed`` that is not an int.
    """

    def __init__(
        self,
        data_source: Sized,
        seed: int,
        replacement: bool = False,
        num_samples: int | None = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self.seed = checked_seed(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` yield the order of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[int]:
        """This epoch's order from position ``start`` on (exact resume).

        See NOTE [ Compact epoch order ]: the same order as torch's ``RandomSampler`` with the
        epoch's generator, held as NumPy arrays.
        """
        self.generator = epoch_generator(self.seed, self.epoch)
        if self.replacement:
            return itertools.islice(super().__iter__(), start, None)
        return itertools.chain.from_iterable(self._permutations_from(start, self.generator))

    def _permutations_from(self, start: int, generator: torch.Generator) -> Iterator[Any]:
        # As RandomSampler: num_samples // n whole permutations, then the head of one more.
        # Yields iterators of ints (chained by the caller: no generator frame per index).
        n, total = len(self.data_source), self.num_samples
        drawn = 0
        while drawn < total:
            order = compact_permutation(n, generator)
            take = min(n, total - drawn)
            if start < drawn + take:
                yield ints_of(order[:take], max(0, start - drawn))
            drawn += take
            del order  # one alive at a time


# NOTE [ Compact epoch order ]
# torch's RandomSampler turns each permutation into a Python list before yielding from it:
# 1.28 M indices are 67 MiB of int objects and 207 ms, 14.2 M (ImageNet-21k) 544 MiB and 3.7 s,
# in the main process, two alive at an epoch boundary. The shuffle samplers here keep the order
# as one NumPy array (int32 below 2**31 samples: 5 MB at 1.28 M) and convert it to ints 65536
# at a time as the loader takes them. The order is the same: torch's CPU ``randperm`` draws the
# same numbers for int32 and int64, and the permutations are drawn from the same generator in
# the same sequence as RandomSampler draws them, so states saved before resume to the same
# samples. ``iter_from`` starts at any position without producing the skipped indices.


class BlockShuffleSampler(Sampler[int]):
    """A shuffle for slow storage: blocks of consecutive records in a random order, shuffled
    together within windows of a few blocks. Off by default; pass it as ``sampler=``.

    See NOTE [ Block shuffle ]. The order of epoch ``e`` is drawn from ``(seed, e)`` only, so
    fastloader.DataLoader prefetches across epochs and resumes exactly from any position
    (``iter_from``; pass the same ``seed``, ``block_size`` and ``window`` when resuming: the
    loader's state does not record them). Every index appears exactly once per epoch.

    Args:
        data_source: the dataset (only its length is used).
        seed: what the order is drawn from, with the epoch.
        block_size: consecutive records read together (64 records of 260 KB: 16 MB).
        window: blocks whose records are shuffled together.

    Raises:
        ValueError: for a ``block_size`` or ``window`` below 1.
        TypeError: for a ``seed`` that is not an int.
    """

    def __init__(self, data_source: Sized, seed: int, block_size: int = 64, window: int = 8):
        for name, value in (("block_size", block_size), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.data_source = data_source
        self.seed = checked_seed(seed)
        self.block_size = block_size
        self.window = window
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.data_source)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` yield the order of ``epoch``."""
        self.epoch = epoch

    def epoch_order(self) -> np.ndarray:
        """The whole order of the current epoch, as a NumPy array."""
        n = len(self.data_source)
        generator = epoch_generator(self.seed, self.epoch)
        blocks = -(-n // self.block_size)
        block_order = compact_permutation(blocks, generator).astype(np.int64)
        # the records of the blocks in their new order
        starts = block_order * self.block_size
        lengths = np.minimum(starts + self.block_size, n) - starts
        window_of_block = np.arange(blocks) // self.window
        order = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(n)
        # shuffled within each window: sort by (window, a random key)
        keys = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
        within = np.argsort(np.repeat(window_of_block, lengths) + keys, kind="stable")
        return order[within].astype(np.int32 if n < 2**31 else np.int64)

    def iter_from(self, start: int) -> Iterator[int]:
        """This epoch's order from position ``start`` on (exact resume)."""
        return ints_of(self.epoch_order(), start)

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def same_block_probability(self) -> float:
        """The chance that two consecutive samples come from the same block: about
        ``1 / window`` (``(block_size - 1) / (window * block_size - 1)``), against
        ``1 / len(dataset)`` for a full shuffle. See NOTE [ Block shuffle ]."""
        records = min(len(self.data_source), self.window * self.block_size)
        if records <= 1:
            return 1.0
        return (min(self.block_size, records) - 1) / (records - 1)


# NOTE [ Block shuffle ]
# Out of the page cache, a full shuffle reads one record per disk request; on network file
# systems and spinning disks a request costs the same for 4 KB as for a few MB, so records/s
# is requests/s. BlockShuffleSampler reads ``block_size`` consecutive records per block (one
# long read, which the kernel's read-ahead serves), and mixes ``window`` blocks: the blocks are
# put in a random order (a permutation drawn from (seed, epoch)), cut into windows of
# ``window`` blocks, and each window's records are shuffled together (random keys from the
# same generator). How much less random it is:
# - two consecutive samples come from the same block with probability about 1 / window
#   (``same_block_probability``; 0.12 with the defaults) instead of 1 / N;
# - a batch of b samples holds records of about min(b, window) blocks, i.e. runs of
#   ``block_size`` neighbours in the pack. A pack written in class order (fastloader-pack
#   sorts by class) then gives batches of a few classes each: use block shuffle only on a pack
#   written in a shuffled order, or with blocks much smaller than a class.
# Where in the epoch a record lands is still uniform: blocks move anywhere.


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
