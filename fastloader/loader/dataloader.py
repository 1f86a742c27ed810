"""fastloader.DataLoader: torch's DataLoader with persistent workers, seeding and epoch state."""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler, IterableDataset

from fastloader.loader import mixing
from fastloader.loader.cursor import EpochCursor
from fastloader.loader.iterators import SingleProcessIter, WorkerPoolIter
from fastloader.loader.lazy_seeding import SeedingMemory
from fastloader.loader.resume import build_state, resume_point
from fastloader.loader.seeding import resolve_seed, resolve_seed_rngs
from fastloader.loader.setup_warnings import (
    DEFAULT_DEVICE_PREFETCH,
    check_device_arguments,
    warn_if_shuffle_on_mix,
)
from fastloader.loader.state_checks import validate_state as check_state_fields
from fastloader.sampling.choice import choose_sampler
from fastloader.sampling.distributed import ElasticDistributedSampler
from fastloader.sampling.mix import Mix
from fastloader.sampling.samplers import (
    BlockShuffleSampler,
    EpochShuffleSampler,
    RecordedSetEpoch,
    record_set_epoch,
    samplers_with_set_epoch,
)
from fastloader.stats.downloads import cached_sources
from fastloader.stats.settings import loader_settings
from fastloader.stats.timing import LoaderStats, epoch_length

T_co = TypeVar("T_co", covariant=True)


def resolve_num_workers(num_workers: int | str) -> Any:
    """Return a worker count from the CPUs this process may use for "auto", else ``num_workers``.

    "auto" leaves one CPU to the training process and shares the rest between the processes of
    this node (``LOCAL_WORLD_SIZE``, as set by torchrun). Anything else is left to torch's
    DataLoader to check, so errors have torch's messages and timing (torch accepts
    ``num_workers=2.0`` at construction, for example, and fails when workers start).

    Raises:
        ValueError: for a string other than "auto".
    """
    if isinstance(num_workers, str):
        if num_workers != "auto":
            raise ValueError(f'num_workers must be an int or "auto", got {num_workers!r}')
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return max(1, (cpus or 1) // local_processes - 1)
    return num_workers


class DataLoader(TorchDataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` that keeps its workers and seeds every sample.

    Takes every argument of torch's DataLoader with the same meaning, and these differences:

    - ``persistent_workers`` defaults to True when ``num_workers > 0``; workers start once and
      serve every epoch, even if something resets ``loader._iterator`` or an epoch is left early.
    - While ``dataset[i]`` runs in epoch ``e``, ``random``, ``numpy.random`` and torch's default
      generator are seeded from ``(seed, e, i)``: the same seed gives the same batches for any
      ``num_workers``, and after resuming. ``shuffle=True`` draws each epoch's order from
      ``(seed, e)``, so workers can load the next epoch while this one finishes.
    - ``loader.epoch`` is the current epoch; samplers with ``set_epoch`` get it before each one.
    - ``state_dict()``/``load_state_dict()`` resume exactly in the middle of an epoch.
    - Without ``prefetch_factor``, each worker keeps 2 to 8 batches in flight, as many as
      fit in about 32 MB (measured from the first batch); a ``prefetch_factor`` given is kept.
    - Workers are supervised: one that dies (OOM killer, segfault, Ctrl-C) is replaced and its
      batches re-loaded, identical; a sample that kills its worker 3 times raises
      ``PoisonSampleError`` for its batch. ``iter(loader)`` is torch's iterator class.

    Keyword-only additions (each stored as an attribute of the same name):

    Args:
        num_workers: as torch's, or "auto" for a count from the CPUs this process may use.
        seed: seed of the sampling order and of every sample's RNGs. None derives one from
            the current state of ``generator`` (or of torch's default generator) without
            drawing from it: ``torch.manual_seed``/Lightning's ``seed_everything`` make runs
            repeatable, and the global random stream is left where torch's DataLoader leaves
            it (a model initialised after building the loader is the same as with torch).
            Iterating neither draws from it (torch draws a worker seed per ``iter()``). The
            attribute holds the seed in use.
        seed_rngs: "auto" (default) gives the samples of "always", calling ``dataset[i]``
            once each, but seeds an RNG the dataset was not seen using in its first samples
            once per batch only (see docs/diagnosis.md for its one exception); "always" (or
            True) seeds all three before every sample;
            "never" (or False) leaves the RNGs alone, as torch does: for datasets without
            randomness, or that seed their own generators.
        distributed: shard the dataset across the ranks of the initialised
            ``torch.distributed`` process group, like ``DistributedSampler``.
        device: if set ("cuda", "cuda:1", a torch.device, "cpu"), batches are yielded on that
            device, copied from pinned memory on a side stream ahead of use.
        device_prefetch: how many batches are copied to the device ahead (default 2).
        device_transform: a callable applied to each batch on the device (for example
            ``fastloader.Normalize``); needs ``device``.

    An argument that cannot take effect with the others raises or warns at construction
    (``IneffectiveArgumentWarning``: ``pin_memory=True`` with ``device="cpu"`` or without a
    GPU, ``device_prefetch`` without ``device``); see NOTE [ Arguments that cannot take
    effect ] in ``loader/setup_warnings.py``.

    Raises:
        ValueError, TypeError: for invalid argument values, naming the argument, and for
            ``device_transform`` without ``device``.
        RuntimeError: for ``device="cuda"`` without CUDA, or ``distributed=True`` without an
            initialised process group.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        seed_rngs: bool | str = "auto",
        distributed: bool = False,
        device: str | torch.device | None = None,
        device_prefetch: int = DEFAULT_DEVICE_PREFETCH,
        device_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        num_workers = resolve_num_workers(num_workers)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        seed = resolve_seed(seed, generator)
        seed_rngs = resolve_seed_rngs(seed_rngs)
        resolved_device = _resolve_device(device, device_prefetch)
        check_device_arguments(  # NOTE [ Arguments that cannot take effect ]
            getattr(resolved_device, "type", None),
            device_prefetch,
            device_transform,
            pin_memory,
            bool(pin_memory) and torch.accelerator.is_available(),  # asked only when it matters
        )
        if resolved_device is not None and resolved_device.type == "cuda":
            pin_memory = True
        if sampler is None and batch_sampler is None and isinstance(dataset, Mix):
            warn_if_shuffle_on_mix(shuffle, distributed, dataset)  # its order wins
        sampler, shuffle = choose_sampler(  # NOTE [ Choosing the order ] in sampling/choice.py
            dataset,
            sampler,
            batch_sampler,
            shuffle=shuffle,
            distributed=distributed,
            batch_size=batch_size,
            drop_last=drop_last,
            seed=seed,
        )
        if collate_fn is None and (batch_size is not None or batch_sampler is not None):
            from fastloader.datasets.collate import (
                default_collate,  # names ragged fields in its error
            )

            collate_fn = mixing.collate_for(dataset, default_collate)  # a Mix's: its fields
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.seed = seed
        self.seed_rngs = seed_rngs
        # NOTE [ Prefetch depth by batch bytes ] in loader/prefetch_depth.py
        self._prefetch_by_bytes = prefetch_factor is None
        # where the loader is: epoch, position, resume target (NOTE [ The epoch cursor ] in
        # loader/cursor.py); `epoch` is a property over it
        self._cursor = EpochCursor()
        self.distributed = distributed
        self.device = device
        self.device_prefetch = device_prefetch
        self.device_transform = device_transform
        self.stats = LoaderStats()
        self._warned: set[str] = set()  # warnings given once per loader
        self._epoch_requests = _record_set_epoch_calls(self)
        self._resolved_device = resolved_device
        self._pool: WorkerPoolIter | None = None
        self._epoch_iter: Any = None  # a weak reference to the iterator of the current epoch
        self._seeding_memory = SeedingMemory()  # what seeding learns of the dataset (seeding.py)
        if hasattr(dataset, "attach") and isinstance(self.sampler, mixing.MIX_SAMPLERS):
            dataset.attach(self.seed, self._mix_next_position, self._mix_replan)  # weight changes

    # -- epochs -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch (the next one to run, until it has started)."""
        return self._cursor.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._cursor.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``, from its start.

        Samplers get it through their ``set_epoch``. Calling ``set_epoch`` on the sampler
        itself does the same (see NOTE [ A user's set_epoch wins ] in ``samplers.py``); the
        last call of either wins.

        Raises:
            ValueError: for anything but a non-negative int.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._take_epoch_request()
        self._cursor.jump_to(epoch)

    def _take_epoch_request(self) -> int | None:
        """The epoch of the last ``sampler.set_epoch`` call made by the user, if any."""
        requested = None
        for recorder in self._epoch_requests:
            if requested is None and recorder.requested is not None:
                requested = recorder.requested
            recorder.requested = None
        if requested is None:
            return None
        try:
            epoch = operator.index(requested)  # numpy ints too
        except TypeError:
            epoch = -1
        if isinstance(requested, bool) or epoch < 0:
            raise ValueError(f"sampler.set_epoch got {requested!r}: epochs are non-negative ints")
        return epoch

    def __iter__(self) -> Iterator[Any]:
        """One epoch: torch's iterator class (``_BaseDataLoaderIter``), kept across epochs."""
        epoch, skip = self._cursor.begin(self._take_epoch_request())
        running = self._pool.worker_pids if self._pool is not None else ()
        self.stats.start_epoch(epoch, cached_sources(self.dataset), running)
        # torch draws a worker base seed from the global generator for every new iterator;
        # samples are seeded from (seed, epoch, index) instead, so keep the user's stream intact.
        with torch.random.fork_rng(devices=[]):
            source = self._epoch_source(epoch, skip)
        # torch keeps no iterator without workers; code that shuts down `loader._iterator`'s
        # workers finds them (torch's own test_shuffler_iterdatapipe does)
        self._iterator = source if self.num_workers else None
        pids = source.worker_pids if self.num_workers else [os.getpid()]
        busy = getattr(source, "busy_seconds", None)
        self.stats.watch_workers(self.num_workers, busy, pids, loader_settings(self))
        self._epoch_iter = weakref.ref(source)
        if isinstance(self.sampler, mixing.MIX_SAMPLERS) and self.stats.current is not None:
            self.stats.current.source_counts = mixing.source_counter(self, epoch, skip)
        self.stats.iter_done(epoch_length(self, skip))  # time in iter() is a wait for data
        return source

    def _epoch_source(self, epoch: int, skip: int) -> Iterator[Any]:
        if self.num_workers == 0:
            return SingleProcessIter(self, epoch, skip)
        if not self.persistent_workers:
            source = WorkerPoolIter(self, epoch, skip)
            self.stats.record_worker_startup(source.startup_s)
            return source
        pool = self._pool
        if pool is not None and pool.needs_restart():  # broken, interrupted, or shut down
            self._pool = None
            pool.shutdown()
            pool = None
        if pool is None:
            pool = self._pool = WorkerPoolIter(self, epoch, skip)
            self.stats.record_worker_startup(pool.startup_s)
        else:
            pool.begin_epoch(self, epoch, skip)
        return pool

    @property
    def last_indices(self) -> Any:
        """Which samples the batch handed out last holds (NOTE [ Indices of a batch ]).

        The indices into ``dataset`` the sampler gave for it, in the batch's order: a list
        (this rank's with ``distributed=True``; a batch sampler's own list), one index with
        ``batch_size=None``, and for a ``Mix`` ``(source name, index in that source)`` pairs.
        Correct with workers, batches travelling several to a message, ``device=``, and after
        ``load_state_dict``. A batch whose loading raised counts: in the ``except`` the
        indices are those of the batch that failed. None before an iteration's first batch.

        Raises:
            ValueError: for an iterable dataset (it has no indices), and with
                ``in_order=False`` and workers (batches are handed out as they finish).
        """
        if isinstance(self.dataset, IterableDataset):
            raise ValueError("last_indices: an IterableDataset has no indices")
        if not self.in_order and self.num_workers:
            raise ValueError(
                "last_indices needs in_order=True with workers: with in_order=False batches "
                "are handed out as they finish, not in the order's sequence"
            )
        last = self._cursor.last
        return None if last is None else mixing.readable_indices(self.dataset, last)

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes (empty when none are running)."""
        pool = self._pool
        if pool is None and isinstance(self._iterator, WorkerPoolIter):
            pool = self._iterator  # this epoch's workers (persistent_workers=False)
        if pool is None or pool._shutdown:
            return []
        return pool.worker_pids

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes. The loader can still be iterated (workers restart)."""
        pool, self._pool = self._pool, None
        iterator, self._iterator = self._iterator, None
        if pool is not None:
            pool.shutdown()
        if iterator is not pool and hasattr(iterator, "shutdown"):
            iterator.shutdown()  # a non-persistent epoch's workers

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- resume -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, and what decides its order: small (O(1)) and JSON-able.

        The position is counted in samples of the epoch's order (global samples with
        ``distributed=True``, the same on every rank that took the same number of steps), so
        the state resumes a loader with another ``batch_size``, ``num_workers`` or world size.
        See NOTE [ Resume is exact or refused ] in ``loader/resume.py``.
        """
        return build_state(self, self._cursor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iteration yields exactly the samples still due.

        The seed is taken from the state. A state taken at an epoch boundary continues with
        the next epoch whatever the settings; in the middle of an epoch the order must be the
        same (dataset length, sampler kind, shuffle, drop_last, and for torch's
        DistributedSampler the world size). Version-1 states are still read.

        Raises:
            ValueError: if ``state`` is not a fastloader state, is malformed, or cannot be
                resumed exactly by this loader (naming the field that differs).
        """
        check_state_fields(state)  # every field first, the mix's included
        apply_mix = mixing.prepare_resume(self.dataset, state)  # NOTE [ Resuming a mix whose ...
        epoch, position = resume_point(state, self)
        if apply_mix is not None:
            apply_mix()
        saved_seed = state.get("order", {}).get("sampler_seed")
        if isinstance(saved_seed, bool) or not isinstance(saved_seed, int):
            saved_seed = None
        self.seed = state["seed"]
        self._seed_samplers(state["seed"] if saved_seed is None else saved_seed, saved_seed)
        self.close()  # running workers hold the old seed
        self._take_epoch_request()  # the state is newer than any earlier sampler.set_epoch
        self._cursor.resume_at(epoch, position)

    # -- what a Mix calls (NOTE [ Weight changes ] in sampling/mix.py) ---------------------

    def _mix_next_position(self) -> int:
        """The global position of the mixed stream that the training loop sees next.

        Raises:
            ValueError: in the middle of an epoch with ``device=``: batches already copied to
                the device ahead cannot be taken back.
        """
        epoch, position, mid_epoch = self._next_unseen()
        if mid_epoch and self._resolved_device is not None:
            raise ValueError(
                "cannot change a Mix's weights in the middle of an epoch with device=: batches "
                "are already on the device; change them between epochs or use a schedule"
            )
        return epoch * len(self.dataset) + position

    def _mix_replan(self) -> None:
        """Drop what was loaded ahead with a ``Mix``'s old weights; load again from the next
        unseen position. Workers keep running (in-flight batches are drained)."""
        epoch, position, mid_epoch = self._next_unseen()
        if mid_epoch:
            iterator = self._epoch_iter() if self._epoch_iter is not None else None
        else:  # between epochs: a persistent pool may have started the next one
            iterator, position = self._pool, 0
        if iterator is None:
            return  # the next iteration draws its order afresh
        iterator.begin_epoch(self, epoch, position)
        if mid_epoch:
            self._cursor.restart_at(position)

    def _next_unseen(self) -> tuple[int, int, bool]:
        step = mixing.mix_step(self.sampler, self.batch_size)
        return self._cursor.next_unseen(step, len(self.dataset))

    def _seed_samplers(self, order_seed: int, recorded_seed: int | None) -> None:
        """Give the samplers that draw the order from a seed the order's seed.

        fastloader's samplers take ``order_seed``; torch's DistributedSampler only a seed the
        state recorded for it (``recorded_seed``), as its own seed is the user's choice.
        """
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if isinstance(sampler, (EpochShuffleSampler, ElasticDistributedSampler)):
                sampler.seed = order_seed
            elif isinstance(sampler, BlockShuffleSampler) and recorded_seed is not None:
                sampler.seed = recorded_seed
            elif isinstance(sampler, DistributedSampler) and recorded_seed is not None:
                sampler.seed = recorded_seed


def _resolve_device(device: Any, device_prefetch: Any) -> torch.device | None:
    if isinstance(device_prefetch, bool) or not isinstance(device_prefetch, int):
        raise TypeError(f"device_prefetch must be an int, got {device_prefetch!r}")
    if device_prefetch < 1:
        raise ValueError(f"device_prefetch must be at least 1, got {device_prefetch}")
    if device is None:
        return None
    from fastloader.device import resolve_device

    return resolve_device(device)


def _record_set_epoch_calls(loader: DataLoader) -> list[RecordedSetEpoch]:
    recorders = []
    for sampler in samplers_with_set_epoch(loader):
        recorder = record_set_epoch(sampler)
        if recorder is None:
            continue
        epoch = getattr(sampler, "epoch", 0)
        if recorder.requested is None and isinstance(epoch, int) and epoch > 0:
            recorder.requested = epoch  # set_epoch called before the loader was made
        recorders.append(recorder)
    return recorders
