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

- Datasets with ``__getitems__`` of their own load a whole batch in one call; they are seeded
  once per batch from the batch's first index. A dataset that reads a batch at once but
  transforms each sample (fastloader's packed datasets, users' files) offers
  ``getitems_with(indices, before_each)`` instead: the batch is read in one call, and
  ``before_each(i)`` seeds each sample's decoding and transform from its own index, as with
  plain ``dataset[i]``.
- Iterable datasets have no index: each worker is seeded from ``(seed, epoch, worker_id)`` when
  its iterator yields its first element of the epoch; without workers, as worker 0, and
  between batches the loading states are kept apart from the training loop's.
- In the main process (``num_workers=0``) loading must not disturb the training loop's
  randomness: the training loop's states are saved the first time a batch is about to seed
  (or, unseeded, was found drawing: NOTE [ Lazy seeding ]) and put back when it is loaded
  (``rngs.TrainingStates``), so a batch that seeds nothing saves nothing; with a
  ``collate_fn`` that may draw, and for iterable datasets, the caller swaps all states around
  each batch instead (``RNGStateSwap``).

Which RNGs are seeded before each sample, and how that stays cheap: NOTE [ Lazy seeding ] in
``lazy_seeding.py``. torch's wrappers (``Subset``, ``random_split``'s subsets, ``StackDataset``;
``ConcatDataset`` has no ``__getitems__``) only fan a batch out to the datasets they wrap:
over datasets loaded per sample they are loaded per sample too, each sample under its own seed
(``loads_each_sample``), so a sample does not depend on the batch it falls in; Subsets of a
``getitems_with`` dataset keep its one read per batch, each sample seeded by the index the
sampler gave (``batch_reader``).

Everything in this module except ``resolve_seed`` runs in the process that loads data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from time import perf_counter
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import (
    IterableDataset,
    StackDataset,
    Subset,
    get_worker_info,
)

from fastloader.datasets import collate
from fastloader.loader.lazy_seeding import (
    EachSampleSeeding,
    SeedingMemory,
    annotate,
    probe_length,
)
from fastloader.loader.rngs import NoStates, StateKeeper, TrainingStates, seed_rngs
from fastloader.loader.transport.groups import LoadedGroup, TaskGroup, batch_error
from fastloader.sampling.seeds import _epoch_key, _index_key, _mix64, sample_seed

#: What ``DataLoader(seed_rngs=...)`` accepts; see NOTE [ Lazy seeding ].
SEED_RNGS_MODES = ("auto", "always", "never")


def seeding_options(loader: Any) -> dict[str, Any]:
    """What a loader's ``SeededDataset`` needs to know beyond its seed (for the iterators)."""
    return {
        "seed_rngs": loader.seed_rngs,
        # a collate that draws nothing needs no seeding (NOTE [ Lazy seeding ]), and its
        # batches may travel several to a message (NOTE [ Batches per message ])
        "collate_may_draw": not collate_draws_nothing(loader.collate_fn),
        # what the loader learns of its dataset; the loader's, made with it
        "memory": loader._seeding_memory,
        # the collate that takes a batch read by columns: NOTE [ Batches read by columns ]
        "columns": loader.collate_fn is collate.default_collate,
    }


def collate_draws_nothing(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` draws no random numbers: the default collates (torch's and
    fastloader's), and a collate that says so with ``draws_nothing = True`` (a ``Mix``'s
    ``MixCollate`` over the default). Anything else may draw."""
    if any(collate_fn is fn for fn in collate.DEFAULT_COLLATES):
        return True
    return getattr(collate_fn, "draws_nothing", False) is True


def batch_reader(dataset: Any) -> tuple[Any, list]:
    """The ``getitems_with`` dataset that ``dataset`` is, or that torch Subsets (nested,
    as ``random_split`` makes them) select from, and the Subsets' index lists, outermost first;
    ``(None, [])`` for other datasets."""
    layers = []
    inner = dataset
    while getattr(type(inner), "__getitems__", None) is Subset.__getitems__:
        layers.append(inner.indices)
        inner = inner.dataset
    if callable(getattr(inner, "getitems_with", None)):
        return inner, layers
    return None, []


def loads_each_sample(dataset: Any) -> bool:
    """Whether ``dataset[i]`` is called for each sample, rather than ``__getitems__`` once.

    True for datasets without ``__getitems__``, and for torch's ``Subset`` and ``StackDataset``
    over such datasets (or over fastloader's ``getitems_with`` datasets): their ``__getitems__``
    only fans the batch out, and per-sample loading keeps each sample under its own seed.
    """
    if not callable(getattr(dataset, "__getitems__", None)):
        return True
    kind = getattr(type(dataset), "__getitems__", None)
    if kind is Subset.__getitems__:
        inner = [dataset.dataset]
    elif kind is StackDataset.__getitems__:
        datasets = dataset.datasets
        inner = list(datasets.values() if isinstance(datasets, dict) else datasets)
    else:
        return False
    return all(
        loads_each_sample(child) or callable(getattr(child, "getitems_with", None))
        for child in inner
    )


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
        memory: SeedingMemory | None = None,
        columns: bool = False,
        group_progress: Any = None,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.progress = progress  # shared array: slot -> number of the task being loaded
        # shared array: slot -> which batch of its group (NOTE [ Batches per message ])
        self.group_progress = group_progress
        # shared array: slot -> seconds spent loading (NOTE [ The diagnosis ] in stats/diagnosis.py)
        self.busy = busy
        self.slot = 0  # set in each worker by _WorkerInit
        self.seed_rngs = resolve_seed_rngs(seed_rngs)
        self.collate_may_draw = collate_may_draw
        # a dataset that seeds each sample of a batch read (getitems_with), maybe under Subsets
        self._reader, self._subsets = batch_reader(dataset)
        self._seeds_each_in_batch = self._reader is not None
        # NOTE [ Batches read by columns ]: for the default collate, what the reader offers
        self._read_columns = getattr(self._reader, "read_batch_columns", None) if columns else None
        self._batched = not self._seeds_each_in_batch and not loads_each_sample(dataset)
        self._each = EachSampleSeeding(  # NOTE [ Lazy seeding ]
            seed,
            self.seed_rngs,
            memory if memory is not None else SeedingMemory(),
            probe_length(dataset),
            collate_may_draw,
        )
        self.training: Any = NoStates()  # see keep_training_states

    def keep_training_states(self) -> bool:
        """In the main process: keep the training loop's RNG states as they were across each
        batch (saved only if the batch seeds or draws). False, and nothing done, when the
        caller must swap states around collate too (a ``collate_fn`` that may draw, an
        iterable dataset, ``seed_rngs="never"``)."""
        if self.collate_may_draw or self.seed_rngs == "never":
            return False
        self.training = self._each.training = TrainingStates()
        return True

    def _get(self, index: Any, epoch: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as error:
            annotate(error, index, epoch)
            raise

    def __getitem__(self, task: Task) -> Any:
        if self.progress is not None:
            self.progress[self.slot] = task.number
        started = perf_counter()
        try:
            if self.seed_rngs != "never":  # a batch of one: its only sample is fully seeded
                self.training.save_once()
                seed_rngs(sample_seed(self.seed, task.epoch, task.indices))
            return self._get(task.indices, task.epoch)
        finally:
            self.training.restore()
            if self.busy is not None:
                self.busy[self.slot] += perf_counter() - started

    def __getitems__(self, task: Task | TaskGroup) -> list:
        if type(task) is TaskGroup:  # NOTE [ Batches per message ]
            return self._load_group(task)
        if self.progress is not None:
            self.progress[self.slot] = task.number
        if self.busy is None:  # the main process: nobody reads a busy time
            try:
                return self._load_task(task)
            finally:
                self.training.restore()
        started = perf_counter()
        try:
            return self._load_task(task)
        finally:
            self.busy[self.slot] += perf_counter() - started

    def _load_group(self, group: TaskGroup) -> LoadedGroup:
        # each batch fails alone: its error is its result (NOTE [ Batches per message ])
        loaded = LoadedGroup()
        skipped = dict(group.skipped)  # batches judged poison: their error is their result
        for position, indices in enumerate(group.batches):
            if position in skipped:
                loaded.append(skipped[position])
                continue
            if self.group_progress is not None:
                self.group_progress[self.slot] = position
            try:
                loaded.append(self.__getitems__(Task(group.epoch, indices, group.number)))
            except Exception:
                loaded.append(batch_error(self.slot))
        if self.group_progress is not None:
            self.group_progress[self.slot] = len(group.batches)  # past its loads
        return loaded

    def _load_task(self, task: Task) -> list:
        indices = list(task.indices)
        epoch = task.epoch
        if self._seeds_each_in_batch:
            return self._load_seeding_each(indices, epoch)
        if self._batched:
            if indices and self.seed_rngs != "never":
                self.training.save_once()
                seed_rngs(sample_seed(self.seed, epoch, indices[0]))
            try:
                return self.dataset.__getitems__(indices)
            except Exception as error:
                annotate(error, indices, epoch)
                raise
        if self.seed_rngs == "never":
            get = self._get
            return [get(index, epoch) for index in indices]
        return self._each.load(self.dataset.__getitem__, indices, epoch)

    def _load_seeding_each(self, indices: list, epoch: int) -> list:
        # Packed datasets decode each sample (far dearer than seeding): seeded eagerly.
        read = indices
        for layer in self._subsets:
            read = [layer[index] for index in read]
        if self._read_columns is not None:  # no code of the user's runs per sample: no seeding
            try:
                batch = self._read_columns(read)
            except Exception as error:
                annotate(error, indices, epoch)
                raise
            if batch is not None:
                return batch
        key = _epoch_key(self.seed, epoch)
        seeds_on = self.seed_rngs != "never"
        training = self.training
        current: list = [indices]
        outer: dict = {}  # under Subsets: read index -> the loader's indices, in batch order
        if self._subsets:
            for index, inner in zip(indices, read, strict=True):
                outer.setdefault(inner, []).append(index)

        def seed_sample(index: Any) -> None:
            if outer:
                index = outer[index].pop(0)  # seeded by the index the sampler gave
            current[0] = index
            if seeds_on:
                training.save_once()
                seed_rngs(_mix64(key ^ _index_key(index)))  # == sample_seed(seed, epoch, index)

        try:
            return self._reader.getitems_with(read, seed_sample)
        except Exception as error:
            annotate(error, current[0], epoch)
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

    def __iter__(self) -> Iterator[Any]:
        if self.seed_rngs == "never":
            return iter(self.dataset)
        return self._seeded()

    def _seeded(self) -> Iterator[Any]:
        # Seeded when the first element is asked for, not when torch's fetcher calls iter():
        # without workers that is inside the batch's RNGStateSwap, so the seeding goes to the
        # loading states, not the training loop's.
        info = get_worker_info()
        worker_id = info.id if info is not None else 0
        seed_rngs(sample_seed(self.seed, self.epoch.value, ("worker", worker_id)))
        yield from self.dataset


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
