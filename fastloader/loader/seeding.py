"""The seeding contract: ``(seed, epoch, index) -> RNG states``.

NOTE [ Seeding contract ]

While ``dataset[i]`` runs in epoch ``e``, Python's ``random``, NumPy's global RNG and torch's
default CPU generator are seeded from ``sample_seed(seed, e, i)``. A sample's randomness then
depends only on what it is and when it is used, never on which worker loads it, how many
workers there are, whether they persist, or whether the run was resumed: the same seed gives
the same batches for any ``num_workers``.

The epoch travels with every batch of indices (a ``Task``), not in the worker's state, so a
persistent worker can load batches of the next epoch while the current one is still being
consumed (see NOTE [ Cross-epoch prefetch ] in ``loader/iterators/``).

- Datasets with ``__getitems__`` load a whole batch in one call; they are seeded once per batch
  from the batch's first index. A dataset that reads a batch at once but transforms each
  sample (fastloader's packed datasets) offers ``getitems_with(indices, before_each)``
  instead: the batch is read in one call, and ``before_each(i)`` seeds each sample's
  transform from its own index, as with plain ``dataset[i]``.
- Iterable datasets have no index: each worker is seeded from ``(seed, epoch, worker_id)`` when
  its iterator is created for the epoch.
- In the main process (``num_workers=0``) loading must not disturb the training loop's
  randomness, so the caller swaps RNG states around each batch (``RNGStateSwap``).

NOTE [ Lazy seeding ]

Seeding is not free: ``random.seed`` costs about 3.4 us, ``numpy.random.seed`` 1.5 us and
``torch.manual_seed`` 1.1 us (2-core box, idle), while torch's whole cost for a sample that
returns its index is 0.6-2 us. Seeding all three before every sample made such datasets 4-15x
slower than torch. But a sample that never draws from an RNG cannot tell whether it was seeded,
so with ``seed_rngs="auto"`` (the default) each RNG is seeded before a sample only once the
dataset has been seen drawing from it in this process:

- Each RNG starts *lazy* in each process and turns *eager* (seeded before every sample, for the
  rest of the process) the first time a sample is seen drawing from it.
- Every batch starts by seeding all three RNGs from its first sample's seed, so the first
  sample is always loaded exactly as the contract says, and the lazy RNGs are in a known, clean
  state (no cached Gaussian in ``random`` or NumPy, none in torch). A fingerprint of each lazy
  RNG's state is taken then (``_rngs.FINGERPRINTS``).
- The other samples are loaded seeding only the eager RNGs. Afterwards, if a lazy RNG's
  fingerprint moved, a sample drew from it unseeded: it turns eager and every sample after the
  first is loaded again, seeded (so ``dataset[i]`` may run twice, once per process, the first
  time a dataset draws from an RNG it had not drawn from in that process). If no fingerprint
  moved, no sample drew from a lazy RNG, so each sample is what it would have been had every
  RNG been seeded before it: the batch is the contract's, bit for bit. The lazy RNGs are then
  seeded from the last sample's seed, so ``collate_fn`` sees the states eager seeding leaves
  (skipped for torch's ``default_collate``, which draws nothing).
- In the first batch of a process the fingerprints are also checked after the first sample, so
  a dataset that draws in every sample is found before anything is loaded twice.

A fingerprint moves on every draw (the Mersenne Twister's position or words change, and a
Gaussian draws since none is cached), on reseeding and on ``set_state``. It cannot see a state
*read* without a net draw: ``torch.initial_seed()``, ``get_state()`` used as data, or a draw
inside a save/restore such as ``torch.random.fork_rng()``, which puts the state back. So while
those samples load, the module functions that read states (``random.getstate``,
``numpy.random.get_state``, ``torch.initial_seed``, ``torch.get_rng_state``, also through
``torch.random``; ``fork_rng`` calls ``torch.get_rng_state``) are swapped for wrappers that
record the read (``_rngs.StateReads``), and a read counts as a draw. What still escapes: a
reference bound before loading (``from torch import initial_seed`` at import) or a generator's
own methods (``torch.default_generator.initial_seed()``). A dataset reading an RNG that way, in
samples where nothing else draws from it, sees the batch's first seed instead of its own: it
needs ``seed_rngs="always"`` (all three seeded before every sample, as before "auto").
``seed_rngs="never"`` leaves the RNGs as torch leaves them, for datasets without randomness or
with generators of their own (``np.random.default_rng(...)``).

Datasets with ``__getitems__`` are seeded once per batch and packed datasets
(``getitems_with``) eagerly: both cost far more per sample than seeding. Cost of "auto" for a
dataset without randomness: two ``seed_rngs`` and two fingerprints per batch (about 30 us, 0.1
us a sample at batch 256) instead of three seedings a sample.

Everything in this module except ``resolve_seed`` runs in the process that loads data.
"""

from __future__ import annotations

import hashlib
from time import perf_counter
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from fastloader.datasets import collate
from fastloader.loader.rngs import (
    DIRECT_SEEDERS,
    FINGERPRINTS,
    SEEDERS,
    StateKeeper,
    StateReads,
)
from fastloader.loader.rngs import seed_numpy as _seed_numpy
from fastloader.loader.rngs import seed_python as _seed_python
from fastloader.loader.rngs import seed_torch as _seed_torch
from fastloader.sampling.seeds import (
    _epoch_key,
    _index_key,
    _mix64,
    batch_seeds,
    sample_seed,
)


def seed_rngs(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (global) and torch's default CPU generator.

    torch gets the low 63 bits, so ``torch.initial_seed()`` fits in an int64 as torch's own
    worker seeds do (a dataset may return it, and collating it must not overflow).
    """
    _seed_python(seed)
    _seed_numpy(seed)
    _seed_torch(seed)


#: What ``DataLoader(seed_rngs=...)`` accepts; see NOTE [ Lazy seeding ].
SEED_RNGS_MODES = ("auto", "always", "never")


def seeding_options(loader: Any) -> dict[str, Any]:
    """What a loader's ``SeededDataset`` needs to know beyond its seed (for the iterators)."""
    # fastloader's default collate_fn is torch's with a clearer error

    # the default collate_fns draw nothing: no need to seed for them (NOTE [ Lazy seeding ])
    drawless = (default_collate, collate.default_collate)
    return {
        "seed_rngs": loader.seed_rngs,
        "collate_may_draw": all(loader.collate_fn is not fn for fn in drawless),
    }


def resolve_seed_rngs(value: Any) -> str:
    """The seeding mode for ``DataLoader(seed_rngs=value)``: "auto", "always" or "never".

    True means "always" (seed every RNG before every sample), False "never".

    Raises:
        ValueError: for anything else.
    """
    if value is True:
        return "always"
    if value is False:
        return "never"
    if isinstance(value, str) and value in SEED_RNGS_MODES:
        return value
    raise ValueError(f'seed_rngs must be "auto", "always", "never", True or False, got {value!r}')


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
    [ Supervised workers ] in loader/supervision.py).
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
    ``get_worker_info().dataset`` is pointed back at the user's dataset). Which RNGs it seeds
    before each sample: see NOTE [ Lazy seeding ].
    """

    def __init__(
        self,
        dataset: Any,
        seed: int,
        progress: Any = None,
        seed_rngs: str = "auto",
        busy: Any = None,
        collate_may_draw: bool = True,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.progress = progress  # shared array: slot -> number of the task being loaded
        # shared array: slot -> seconds spent loading (NOTE [ The diagnosis ] in stats/diagnosis.py)
        self.busy = busy
        self.slot = 0  # set in each worker by _WorkerInit
        self.seed_rngs = resolve_seed_rngs(seed_rngs)
        self.collate_may_draw = collate_may_draw
        # Per RNG (SEEDERS order): seeded before every sample once seen drawing in this process.
        self.eager = [self.seed_rngs == "always"] * len(SEEDERS)
        self._probed = False  # whether a batch has been loaded lazily in this process
        self._epoch_key = (-1, 0)  # (epoch, _epoch_key(seed, epoch)) of the last batch
        self._reads_: StateReads | None = None  # made where it is used (it holds functions)
        self._batched = callable(getattr(dataset, "__getitems__", None))
        self._seeds_each_in_batch = callable(getattr(dataset, "getitems_with", None))

    def _get(self, index: Any, epoch: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as error:
            _annotate(error, index, epoch)
            raise

    def __getitem__(self, task: Task) -> Any:
        if self.progress is not None:
            self.progress[self.slot] = task.number
        started = perf_counter()
        try:
            if self.seed_rngs != "never":  # a batch of one: its only sample is fully seeded
                seed_rngs(sample_seed(self.seed, task.epoch, task.indices))
            return self._get(task.indices, task.epoch)
        finally:
            if self.busy is not None:
                self.busy[self.slot] += perf_counter() - started

    def __getitems__(self, task: Task) -> list:
        if self.progress is not None:
            self.progress[self.slot] = task.number
        if self.busy is None:  # the main process: nobody reads a busy time
            return self._load_task(task)
        started = perf_counter()
        try:
            return self._load_task(task)
        finally:
            self.busy[self.slot] += perf_counter() - started

    def _load_task(self, task: Task) -> list:
        indices = list(task.indices)
        epoch = task.epoch
        if self._seeds_each_in_batch:
            return self._load_seeding_each(indices, epoch)
        if self._batched:
            if indices and self.seed_rngs != "never":
                seed_rngs(sample_seed(self.seed, epoch, indices[0]))
            try:
                return self.dataset.__getitems__(indices)
            except Exception as error:
                _annotate(error, indices, epoch)
                raise
        if self.seed_rngs == "never":
            get = self._get
            return [get(index, epoch) for index in indices]
        return self._load_each(indices, epoch)

    def _load_each(self, indices: list, epoch: int) -> list:
        """``dataset[i]`` for each index, seeded as the contract says. NOTE [ Lazy seeding ]"""
        if not indices:
            return []
        if not all(self.eager):
            return self._load_lazily(indices, epoch)
        samples: list = []
        append = samples.append
        getitem = self.dataset.__getitem__
        seeds = batch_seeds(self.seed, epoch, indices)
        try:
            for index, sample_seed_ in zip(indices, seeds, strict=True):
                seed_rngs(sample_seed_)
                append(getitem(index))
        except Exception as error:
            _annotate(error, indices[len(samples)], epoch)
            raise
        return samples

    @property
    def _reads(self) -> StateReads:
        if self._reads_ is None:
            self._reads_ = StateReads()
        return self._reads_

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reads_": None}  # (spawned workers) made again there

    def _sample_seed(self, epoch: int, index: Any) -> int:
        if self._epoch_key[0] != epoch:
            self._epoch_key = (epoch, _epoch_key(self.seed, epoch))
        return _mix64(self._epoch_key[1] ^ _index_key(index))  # == sample_seed(...)

    def _load_lazily(self, indices: list, epoch: int) -> list:
        # See NOTE [ Lazy seeding ]: the first sample is seeded fully; the others only in the
        # RNGs seen drawing. If an unseeded RNG was drawn from, the samples after the first
        # are loaded again, seeding it too.
        seed_rngs(self._sample_seed(epoch, indices[0]))
        if len(indices) == 1:  # a batch of one: its only sample is fully seeded
            return [self._get(indices[0], epoch)]
        lazy = [rng for rng, eager in enumerate(self.eager) if not eager]
        before = [FINGERPRINTS[rng]() for rng in lazy]
        samples = [self._get(indices[0], epoch)]
        rest = indices[1:]
        if not self._probed:  # the first batch: find a dataset that always draws at once
            self._probed = True
            if self._drew(lazy, before):
                return samples + self._load_each(rest, epoch)
        seeders = [seeder for seeder, eager in zip(SEEDERS, self.eager, strict=True) if eager]
        append = samples.append
        getitem = self.dataset.__getitem__
        reads = self._reads
        try:
            reads.__enter__()
            if len(seeders) == 1 and seeders[0] in DIRECT_SEEDERS:  # the common case, inlined
                seeder, mask = DIRECT_SEEDERS[seeders[0]]
                seeds = [seed & mask for seed in batch_seeds(self.seed, epoch, rest)]
                for index, sample_seed_ in zip(rest, seeds, strict=True):
                    seeder(sample_seed_)
                    append(getitem(index))
            elif seeders:
                for index, sample_seed_ in zip(
                    rest, batch_seeds(self.seed, epoch, rest), strict=True
                ):
                    for seeder in seeders:
                        seeder(sample_seed_)
                    append(getitem(index))
            else:
                samples.extend(map(getitem, rest))  # appends one by one: len tells who raised
        except Exception as error:
            reads.__exit__()
            if self._drew(lazy, before, reads.read):  # the error may come from an unseeded draw
                return samples[:1] + self._load_each(rest, epoch)
            _annotate(error, indices[len(samples)], epoch)
            raise
        except BaseException:
            reads.__exit__()
            raise
        reads.__exit__()
        if self._drew(lazy, before, reads.read):
            return samples[:1] + self._load_each(rest, epoch)
        if rest and self.collate_may_draw:  # what collate_fn sees under "always"
            last_seed = self._sample_seed(epoch, indices[-1])
            for rng in lazy:
                SEEDERS[rng](last_seed)
        return samples

    def _drew(self, lazy: list[int], before: list, read: list[bool] | None = None) -> bool:
        """Mark the RNGs of ``lazy`` whose state moved since ``before`` (or was ``read``) as
        eager; were there any?"""
        moved = False
        for rng, fingerprint in zip(lazy, before, strict=True):
            if (read is not None and read[rng]) or FINGERPRINTS[rng]() != fingerprint:
                self.eager[rng] = True
                moved = True
        return moved

    def _load_seeding_each(self, indices: list, epoch: int) -> list:
        # Packed datasets decode each sample (far dearer than seeding): seeded eagerly.
        key = _epoch_key(self.seed, epoch)
        seeds_on = self.seed_rngs != "never"
        current: list = [indices]

        def seed_sample(index: Any) -> None:
            current[0] = index
            if seeds_on:
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

    def __init__(
        self, dataset: IterableDataset, seed: int, epoch: Any, seed_rngs: str = "auto"
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = epoch  # a multiprocessing RawValue, shared with the main process
        self.seed_rngs = resolve_seed_rngs(seed_rngs)

    def __iter__(self):
        if self.seed_rngs != "never":
            info = get_worker_info()
            worker_id = info.id if info is not None else 0
            seed_rngs(sample_seed(self.seed, self.epoch.value, ("worker", worker_id)))
        return iter(self.dataset)


class RNGStateSwap:
    """Keeps the data-loading RNG states apart from the training loop's, in one process.

    Used around each batch loaded in the main process: the training loop's states are saved
    and restored. With ``carry`` (iterable datasets, seeded once per epoch) the loading states
    are also carried from batch to batch; a map-style dataset's batch seeds every RNG before
    its first sample (NOTE [ Lazy seeding ]), so there is nothing to carry. Disabled
    (``seed_rngs="never"``), loading draws from the training loop's RNGs, as torch's does.
    """

    def __init__(self, carry: bool = True, enabled: bool = True) -> None:
        self._carry = carry
        self._enabled = enabled
        self._training = StateKeeper()
        self._loading = StateKeeper()
        self._loading_states: tuple | None = None

    def __enter__(self) -> RNGStateSwap:
        if self._enabled:
            self._training_states = self._training.save()
            if self._loading_states is not None:
                self._loading.restore(self._loading_states)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._enabled:
            if self._carry:
                self._loading_states = self._loading.save()
            self._training.restore(self._training_states)
            del self._training_states
