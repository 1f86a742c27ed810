"""The seeding contract: ``(seed, epoch, index) -> RNG states``.

NOTE [ Seeding contract ]

While ``dataset[i]`` runs in epoch ``e``, Python's ``random``, NumPy's global RNG and torch's
default CPU generator are seeded from ``sample_seed(seed, e, i)``. A sample's randomness then
depends only on what it is and when it is used, never on which worker loads it, how many
workers there are, whether they persist, or whether the run was resumed: the same seed gives
the same batches for any ``num_workers``.

The epoch travels with every batch of indices (a ``Task``), not in the worker's state, so a
persistent worker can load batches of the next epoch while the current one is still being
consumed (see NOTE [ Cross-epoch prefetch ] in ``_iterators.py``).

- Datasets with ``__getitems__`` load a whole batch in one call; they are seeded once per batch
  from the batch's first index. A dataset that reads a batch at once but transforms each
  sample (fastloader's packed datasets) offers ``getitems_with(indices, before_each)``
  instead: the batch is read in one call, and ``before_each(i)`` seeds each sample's
  transform from its own index, as with plain ``dataset[i]``.
- Iterable datasets have no index: each worker is seeded from ``(seed, epoch, worker_id)`` when
  its iterator is created for the epoch.
- In the main process (``num_workers=0``) loading must not disturb the training loop's
  randomness, so the caller swaps RNG states around each batch (``RNGStateSwap``).

Everything in this module except ``resolve_seed`` runs in the process that loads data.
"""

from __future__ import annotations

import _random
import hashlib
import operator
import random
import zlib
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a cheap, well-distributed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _index_key(index: Any) -> int:
    try:
        return operator.index(index) & _MASK64
    except TypeError:
        # Non-integer keys (strings, tuples): a hash that is stable across processes,
        # unlike hash(), which is salted per interpreter.
        return zlib.crc32(repr(index).encode())


def _epoch_key(seed: int, epoch: int) -> int:
    return _mix64(_mix64(seed & _MASK64) ^ (epoch & _MASK64))


def sample_seed(seed: int, epoch: int, index: Any) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` for a loader seeded with ``seed``."""
    return _mix64(_epoch_key(seed, epoch) ^ _index_key(index))


def epoch_seed(seed: int, epoch: int) -> int:
    """The 63-bit seed from which the shuffle order of ``epoch`` is drawn."""
    return _mix64(_mix64(seed & _MASK64 ^ 0x5EED) ^ (epoch & _MASK64)) >> 1


# random.seed(int) is Random.seed (Python) around the C seeding; calling the C part directly
# and resetting gauss_next as the wrapper does saves a tenth of the per-sample cost.
_python_rng = random._inst
_seed_python_rng = _random.Random.seed


_MASK63 = (1 << 63) - 1


def seed_rngs(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (global) and torch's default CPU generator.

    torch gets the low 63 bits, so ``torch.initial_seed()`` fits in an int64 as torch's own
    worker seeds do (a dataset may return it, and collating it must not overflow).
    """
    _seed_python_rng(_python_rng, seed)
    _python_rng.gauss_next = None
    np.random.seed(seed & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed & _MASK63)


def resolve_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """Return ``seed``, or, when it is None, one derived from ``generator``'s current state.

    The state of ``generator`` (torch's default generator when None) is hashed, not drawn
    from: building a loader leaves the global random stream exactly where torch's DataLoader
    leaves it, so a model initialised after the loader is the same as with torch, while
    ``torch.manual_seed(s)`` before the loader still makes the seed repeatable. Two loaders
    built with no draw between them get the same seed.

    Raises:
        TypeError: if ``seed`` is neither an int nor None.
    """
    if seed is None:
        source = generator if generator is not None else torch.default_generator
        state = source.get_state().numpy().tobytes()
        return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 1
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}: {seed!r}")
    return int(seed)


class Task(NamedTuple):
    """What the main process sends a worker: the epoch and the (batch of) indices to load.

    ``number`` is torch's task number (``send_idx``) when the task goes to a worker process;
    the worker records it while loading, so a death is blamed on the right task (NOTE
    [ Supervised workers ] in _supervision.py).
    """

    epoch: int
    indices: Any
    number: int = -1


def _annotate(error: BaseException, index: Any, epoch: int) -> None:
    # Notes are printed with the traceback, and torch's ExceptionWrapper copies the formatted
    # traceback into the message it re-raises in the main process.
    if hasattr(error, "add_note"):
        error.add_note(f"fastloader: raised while loading sample index {index!r} (epoch {epoch})")


class SeededDataset:
    """Wraps a map-style dataset so that each item is loaded under its own seed.

    It receives ``Task`` objects from the sampler side and hands plain indices to the
    wrapped dataset. Only fastloader's iterators create it; users never see it (the worker's
    ``get_worker_info().dataset`` is pointed back at the user's dataset).
    """

    def __init__(self, dataset: Any, seed: int, progress: Any = None) -> None:
        self.dataset = dataset
        self.seed = seed
        self.progress = progress  # shared array: slot -> number of the task being loaded
        self.slot = 0  # set in each worker by _WorkerInit
        self._batched = callable(getattr(dataset, "__getitems__", None))
        self._seeds_each_in_batch = callable(getattr(dataset, "getitems_with", None))

    def _load(self, index: Any, epoch: int, epoch_key: int) -> Any:
        seed_rngs(_mix64(epoch_key ^ _index_key(index)))  # == sample_seed(seed, epoch, index)
        try:
            return self.dataset[index]
        except Exception as error:
            _annotate(error, index, epoch)
            raise

    def __getitem__(self, task: Task) -> Any:
        if self.progress is not None:
            self.progress[self.slot] = task.number
        return self._load(task.indices, task.epoch, _epoch_key(self.seed, task.epoch))

    def __getitems__(self, task: Task) -> list:
        if self.progress is not None:
            self.progress[self.slot] = task.number
        indices = list(task.indices)
        if self._seeds_each_in_batch:
            return self._load_seeding_each(indices, task.epoch)
        if not self._batched:
            key = _epoch_key(self.seed, task.epoch)
            return [self._load(index, task.epoch, key) for index in indices]
        if indices:
            seed_rngs(sample_seed(self.seed, task.epoch, indices[0]))
        try:
            return self.dataset.__getitems__(indices)
        except Exception as error:
            _annotate(error, indices, task.epoch)
            raise

    def _load_seeding_each(self, indices: list, epoch: int) -> list:
        key = _epoch_key(self.seed, epoch)
        current: list = [indices]

        def seed_sample(index: Any) -> None:
            current[0] = index
            seed_rngs(_mix64(key ^ _index_key(index)))  # == sample_seed(seed, epoch, index)

        try:
            return self.dataset.getitems_with(indices, seed_sample)
        except Exception as error:
            _annotate(error, current[0], epoch)
            raise

    def __len__(self) -> int:
        return len(self.dataset)


class SeededIterableDataset(IterableDataset):
    """Wraps an iterable dataset so each worker's pass is seeded from (seed, epoch, worker)."""

    def __init__(self, dataset: IterableDataset, seed: int, epoch: Any) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = epoch  # a multiprocessing RawValue, shared with the main process

    def __iter__(self):
        info = get_worker_info()
        worker_id = info.id if info is not None else 0
        seed_rngs(sample_seed(self.seed, self.epoch.value, ("worker", worker_id)))
        return iter(self.dataset)


class RNGStateSwap:
    """Keeps the data-loading RNG states apart from the training loop's, in one process.

    Used around each batch loaded in the main process: the training loop's states are saved
    and restored, and the loading states (which matter for iterable datasets, seeded once per
    epoch) are carried from batch to batch.
    """

    def __init__(self) -> None:
        self._loading_states: tuple | None = None

    def __enter__(self) -> RNGStateSwap:
        self._training_states = _get_states()
        if self._loading_states is not None:
            _set_states(self._loading_states)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._loading_states = _get_states()
        _set_states(self._training_states)
        del self._training_states


def _get_states() -> tuple:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_states(states: tuple) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
