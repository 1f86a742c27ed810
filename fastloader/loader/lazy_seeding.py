"""Each sample of a batch loaded under its own seed, at next to no cost for datasets that draw
nothing: the probe, the lazy batches, and what a loader remembers of its dataset.

Runs in the process that loads data (a worker, or the main process with ``num_workers=0``);
``SeedingMemory`` is made in the main process and shared with the workers.

NOTE [ Lazy seeding ]

Seeding is not free: ``random.seed`` costs about 3.5 us, ``numpy.random.seed`` 1.7 us and
``torch.manual_seed`` 1.2 us (2-core box, idle), while torch's whole cost for a sample that
returns its index is 0.3-2 us. Seeding all three before every sample made such datasets 4-15x
slower than torch. A sample that never draws from an RNG cannot tell whether it was seeded, so
with ``seed_rngs="auto"`` (the default) an RNG the dataset has not been seen using is left
unseeded between the samples of a batch. But datasets are not pure: they cache, count, keep
private RNGs, append to files. A sample loaded from an unseeded RNG cannot be taken back, and
loading it again runs ``__getitem__`` twice (a cache keeps the first, unseeded, value; a
private RNG moves twice). So nothing is loaded twice while the loader is still learning:

- **The probe.** A loader's first ``min(len(dataset), PROBE_SAMPLES)`` samples (counted over
  all its processes, workers started later included) are loaded with all three RNGs seeded
  before every sample, as ``seed_rngs="always"`` does, and each RNG's fingerprint
  (``rngs.FINGERPRINTS``) is compared before and after each sample: an RNG that moved, or whose
  state was read (below), is one the dataset *uses*. The probe also times the samples.
- **After the probe**, an RNG the dataset uses stays seeded before every sample; so do all
  three when a sample took ``EAGER_ABOVE_S`` or more on average (seeding is then 3 % of a
  sample or less, and nothing is left to chance). The others are *lazy*: every batch seeds all
  three from its first sample's seed (so the first sample is the contract's), loads it, takes
  the lazy RNGs' fingerprints, loads the other samples seeding only the used RNGs, and compares
  the fingerprints after. Unmoved, no other sample drew from a lazy RNG, so every sample is
  what it would have been had every RNG been seeded before it: the batch is the contract's, bit
  for bit. The lazy RNGs are then seeded
  from the last sample's seed, so ``collate_fn`` sees the states eager seeding leaves (skipped
  for the default collate functions, which draw nothing).
- **Unseeded batches.** When the dataset uses no RNG at all and the default collate draws
  nothing, not even the first sample is seeded: the fingerprints of all three RNGs are taken
  before the batch and compared after it (with the reads below). Unmoved and unread, no
  sample could tell which state it ran in, and the batch is again the contract's; a batch of
  cheap samples then costs two sets of fingerprints and no seeding (main process: not even a
  save of the training loop's states, which are what the samples ran in). This needs
  fingerprints that see a draw from any state, not only a freshly seeded one (NumPy's cached
  Gaussian: NOTE [ NumPy's cached Gaussian without get_state ] in rngs.py); without them the
  first sample is seeded as above.
- **The one exception**: a dataset that first uses an RNG after its probe (it draws only for
  some indices, rarely, or once something outside changes). The batch where that is found is
  loaded again with every RNG seeded (all of it for an unseeded batch, else all but its
  first sample), the RNG is used from then on by every process, and a
  ``RuntimeWarning`` says so. A pure ``__getitem__`` gives exactly the samples of "always"; one
  that caches, counts or keeps its own RNG has run twice for those samples: such a dataset
  needs ``seed_rngs="always"``. Bounded: once per RNG per loader (per process for samples in
  flight), at most one batch each time.

What the memory holds (``SeedingMemory``) lives as long as the loader, shared with its workers,
so workers restarted every epoch (``persistent_workers=False``) or replaced after a death
neither probe again nor call ``__getitem__`` twice.

A fingerprint moves on every draw (the Mersenne Twister's position or words change, and a
Gaussian draws since none is cached), on reseeding and on ``set_state``. It cannot see a state
*read* without a net draw: ``torch.initial_seed()``, ``get_state()`` used as data, or a draw
inside a save/restore such as ``torch.random.fork_rng()``, which puts the state back. So while
samples load, the module functions that read states (``random.getstate``,
``numpy.random.get_state`` and ``numpy.random.get_bit_generator``, also through
``numpy.random.mtrand``; ``torch.initial_seed``, ``torch.get_rng_state``, also through
``torch.random``; ``fork_rng`` calls ``torch.get_rng_state``) are swapped for wrappers that
record the read (``state_reads.StateReads``), and a read counts as a draw. What still escapes: a
reference bound before loading (``from torch import initial_seed`` at import), a generator's
own methods (``torch.default_generator.initial_seed()``, ``np.random.mtrand._rand.get_state()``)
or a bit generator kept from before. A dataset reading an RNG only that way, in samples where
nothing else draws from it and only after its probe, sees the batch's first seed instead of
its own: it needs ``seed_rngs="always"``.

Datasets with ``__getitems__`` are seeded once per batch and packed datasets
(``getitems_with``) eagerly: both cost far more per sample than seeding. Cost of "auto" for a
dataset without randomness, after the probe: two sets of fingerprints and the read wrappers
per batch (about 9 us in a microbenchmark, 20-25 us in a loader's loop, where the 10 KB of
RNG state are read cold after the batch's data; with a collate_fn that may draw, the first
sample seeded and a swap of all states around the batch instead);
the probe costs about 14 us a sample, once per loader.
"""

from __future__ import annotations

import multiprocessing
import warnings
from multiprocessing.context import get_spawning_popen
from time import perf_counter
from typing import Any

from fastloader.loader.rngs import (
    DIRECT_SEEDERS,
    FINGERPRINTS,
    NAMES,
    SEEDERS,
    NoStates,
    all_fingerprints,
    fingerprints_see_everything,
    seed_rngs,
    states_from_fingerprints,
)
from fastloader.loader.state_reads import StateReads
from fastloader.sampling.seeds import _epoch_key, _index_key, _mix64, batch_seeds

#: Samples loaded with every RNG seeded before any RNG is left lazy (NOTE [ Lazy seeding ]).
PROBE_SAMPLES = 4096
#: Mean seconds a probed sample takes from which every RNG stays seeded (NOTE [ Lazy seeding ]).
EAGER_ABOVE_S = 200e-6

_EVERY_RNG = list(range(len(SEEDERS)))
_PROBED, _PROBE_NS, _USED = 0, 1, 2  # slots of SeedingMemory.shared; _USED + rng per RNG


class SeedingMemory:
    """What a loader has learnt of its dataset's RNG use, shared by the loader's processes.

    See NOTE [ Lazy seeding ]. Counters are updated without a lock: a lost update lengthens
    the probe by a batch, and the flags only ever go from 0 to 1.
    """

    def __init__(self, values: list[int] | None = None) -> None:
        self.shared = multiprocessing.RawArray("q", values or [0] * (_USED + len(SEEDERS)))

    def __reduce__(self) -> tuple:
        # Workers being started get the shared array itself; anything else (a copy or pickle
        # of the loader) a snapshot of what is known.
        if get_spawning_popen() is not None:
            return _attached, (self.shared,)
        return SeedingMemory, (list(self.shared),)

    def probed(self) -> int:
        return self.shared[_PROBED]

    def uses(self, rng: int) -> bool:
        return bool(self.shared[_USED + rng])

    def mark_used(self, rng: int) -> None:
        self.shared[_USED + rng] = 1

    def record_probe(self, samples: int, seconds: float) -> None:
        self.shared[_PROBED] += samples
        self.shared[_PROBE_NS] += int(seconds * 1e9)

    def unused_rngs(self, probe_samples: int) -> list[int] | None:
        """The RNGs no sample has used; None until ``probe_samples`` were probed; none if the
        probed samples took ``EAGER_ABOVE_S`` or more on average. (One read of the shared
        counters: it runs every batch.)"""
        values = self.shared[:]
        probed, probe_ns, used = values[_PROBED], values[_PROBE_NS], values[_USED:]
        if probed < probe_samples:
            return None
        if probed > 0 and probe_ns >= probed * EAGER_ABOVE_S * 1e9:  # slow samples
            return []
        return [rng for rng, flag in enumerate(used) if not flag]


def _attached(shared: Any) -> SeedingMemory:
    memory = SeedingMemory.__new__(SeedingMemory)
    memory.shared = shared
    return memory


def annotate(error: BaseException, index: Any, epoch: int) -> None:
    """Name the sample being loaded in ``error``'s traceback."""
    # Notes are printed with the traceback, and torch's ExceptionWrapper copies the formatted
    # traceback into the message it re-raises in the main process.
    if hasattr(error, "add_note"):
        error.add_note(f"fastloader: raised while loading sample index {index!r} (epoch {epoch})")


def probe_length(dataset: Any) -> int:
    """How many samples the probe loads: ``PROBE_SAMPLES``, or one epoch if that is less."""
    try:
        return min(len(dataset), PROBE_SAMPLES)
    except TypeError:
        return PROBE_SAMPLES


class EachSampleSeeding:
    """Loads ``dataset[i]`` for each index of a batch, each sample under its own seed.

    ``mode`` is "auto" or "always" (NOTE [ Lazy seeding ]); ``memory`` is the loader's.
    """

    def __init__(
        self,
        seed: int,
        mode: str,
        memory: SeedingMemory,
        probe_samples: int,
        collate_may_draw: bool = True,
    ) -> None:
        self.seed = seed
        self.always = mode == "always"
        self.memory = memory
        self.probe_samples = probe_samples
        self.collate_may_draw = collate_may_draw
        self._epoch_key = (-1, 0)  # (epoch, _epoch_key(seed, epoch)) of the last batch
        self._reads_: StateReads | None = None  # made where it is used (it holds functions)
        # the training loop's states, saved before seeding (main process: rngs.TrainingStates)
        self.training: Any = NoStates()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reads_": None}  # (spawned workers) made again there

    @property
    def _reads(self) -> StateReads:
        if self._reads_ is None:
            self._reads_ = StateReads()
        return self._reads_

    def _sample_seed(self, epoch: int, index: Any) -> int:
        if self._epoch_key[0] != epoch:
            self._epoch_key = (epoch, _epoch_key(self.seed, epoch))
        return _mix64(self._epoch_key[1] ^ _index_key(index))  # == sample_seed(...)

    def lazy_rngs(self) -> list[int] | None:
        """The RNGs left unseeded between a batch's samples; None while the probe runs."""
        if self.always:
            return []
        return self.memory.unused_rngs(self.probe_samples)

    def load(self, getitem: Any, indices: list, epoch: int) -> list:
        """``[getitem(i) for i in indices]``, seeded as NOTE [ Lazy seeding ] says."""
        if not indices:
            return []
        lazy = self.lazy_rngs()
        if lazy is None:
            return self._probe(getitem, indices, epoch)
        if (
            len(lazy) == len(SEEDERS)
            and not self.collate_may_draw
            and fingerprints_see_everything()
        ):
            return self._unseeded(getitem, indices, epoch)
        if not lazy or len(indices) == 1:  # a batch of one: its only sample is fully seeded
            return self._eager(getitem, indices, epoch)
        return self._lazily(getitem, indices, epoch, lazy)

    def _eager(self, getitem: Any, indices: list, epoch: int) -> list:
        self.training.save_once()
        samples: list = []
        append = samples.append
        try:
            for index, seed in zip(indices, batch_seeds(self.seed, epoch, indices), strict=True):
                seed_rngs(seed)
                append(getitem(index))
        except Exception as error:
            annotate(error, indices[len(samples)], epoch)
            raise
        return samples

    def _probe(self, getitem: Any, indices: list, epoch: int) -> list:
        # Every sample fully seeded; which RNGs the samples use is recorded.
        self.training.save_once()
        unseen = [rng for rng in range(len(SEEDERS)) if not self.memory.uses(rng)]
        samples: list = []
        append = samples.append
        spent = 0.0
        reads = self._reads.__enter__()
        try:
            for index, seed in zip(indices, batch_seeds(self.seed, epoch, indices), strict=True):
                seed_rngs(seed)
                before = [FINGERPRINTS[rng]() for rng in unseen]
                started = perf_counter()
                append(getitem(index))
                spent += perf_counter() - started
                if unseen:
                    unseen = self._unmoved(unseen, before)
        except Exception as error:
            annotate(error, indices[len(samples)], epoch)
            raise
        finally:
            reads.__exit__()
            for rng, read in enumerate(reads.read):
                if read:
                    self.memory.mark_used(rng)
        self.memory.record_probe(len(indices), spent)
        return samples

    def _unmoved(self, rngs: list[int], before: list) -> list[int]:
        """The RNGs of ``rngs`` whose fingerprint is still ``before``; the others are used."""
        still = []
        for rng, fingerprint in zip(rngs, before, strict=True):
            if FINGERPRINTS[rng]() == fingerprint:
                still.append(rng)
            else:
                self.memory.mark_used(rng)
        return still

    def _unseeded(self, getitem: Any, indices: list, epoch: int) -> list:
        # NOTE [ Lazy seeding ], unseeded batches: nothing is seeded; if no RNG moved and none
        # was read, no sample could tell, and the batch is the contract's.
        before = all_fingerprints()
        samples: list = []
        reads = self._reads.__enter__()
        try:
            samples.extend(map(getitem, indices))  # appends one by one: len tells who raised
        except Exception as error:
            reads.__exit__()
            if self._found_use(_EVERY_RNG, before, reads.read, indices):  # maybe the cause
                return self._again(getitem, indices, epoch, before)
            annotate(error, indices[len(samples)], epoch)
            raise
        except BaseException:
            reads.__exit__()
            self.training.save_once(states_from_fingerprints(before))  # maybe drawn from
            raise
        reads.__exit__()
        if not any(reads.read) and all_fingerprints() == before:
            return samples  # the common case, without _found_use's bookkeeping
        if self._found_use(_EVERY_RNG, before, reads.read, indices):
            return self._again(getitem, indices, epoch, before)
        return samples

    def _again(self, getitem: Any, indices: list, epoch: int, before: list) -> list:
        # An unseeded batch drew from or read an RNG: the states it started from were the
        # training loop's (main process), and every sample is loaded again, seeded.
        self.training.save_once(states_from_fingerprints(before))
        return self._eager(getitem, indices, epoch)

    def _lazily(self, getitem: Any, indices: list, epoch: int, lazy: list[int]) -> list:
        # See NOTE [ Lazy seeding ]: the first sample is seeded fully; the others only in the
        # RNGs the dataset uses. If a lazy RNG was drawn from, the batch is loaded again.
        self.training.save_once()
        seed_rngs(self._sample_seed(epoch, indices[0]))
        try:
            samples = [getitem(indices[0])]
        except Exception as error:
            annotate(error, indices[0], epoch)
            raise
        # taken after the first sample: what it drew was seeded, and matters to no other
        before = [FINGERPRINTS[rng]() for rng in lazy]
        rest = indices[1:]
        seeders = [SEEDERS[rng] for rng in range(len(SEEDERS)) if rng not in lazy]
        reads = self._reads.__enter__()
        try:
            self._load_rest(getitem, rest, epoch, seeders, samples)
        except Exception as error:
            reads.__exit__()
            if self._found_use(lazy, before, reads.read, rest):  # the error may come from it
                return samples[:1] + self._eager(getitem, rest, epoch)
            annotate(error, indices[len(samples)], epoch)
            raise
        except BaseException:
            reads.__exit__()
            raise
        reads.__exit__()
        if self._found_use(lazy, before, reads.read, rest):
            return samples[:1] + self._eager(getitem, rest, epoch)
        if self.collate_may_draw:  # what collate_fn sees under "always"
            last_seed = self._sample_seed(epoch, indices[-1])
            for rng in lazy:
                SEEDERS[rng](last_seed)
        return samples

    def _load_rest(
        self, getitem: Any, rest: list, epoch: int, seeders: list, samples: list
    ) -> None:
        """Append ``getitem(i)`` for each of ``rest`` to ``samples``, seeding ``seeders``."""
        append = samples.append
        if len(seeders) == 1 and seeders[0] in DIRECT_SEEDERS:  # the common case, inlined
            seeder, mask = DIRECT_SEEDERS[seeders[0]]
            for index, seed in zip(rest, batch_seeds(self.seed, epoch, rest), strict=True):
                seeder(seed & mask)
                append(getitem(index))
        elif seeders:
            for index, seed in zip(rest, batch_seeds(self.seed, epoch, rest), strict=True):
                for seeder in seeders:
                    seeder(seed)
                append(getitem(index))
        else:
            samples.extend(map(getitem, rest))  # appends one by one: len tells who raised

    def _found_use(self, lazy: list[int], before: list, read: list[bool], rest: list) -> bool:
        """Whether a lazy RNG moved since ``before`` or was read: the exception of NOTE
        [ Lazy seeding ]. Such RNGs are used from now on, and a warning says so."""
        found = [
            rng
            for rng, fingerprint in zip(lazy, before, strict=True)
            if read[rng] or FINGERPRINTS[rng]() != fingerprint
        ]
        for rng in found:
            self.memory.mark_used(rng)
        if found:
            names = ", ".join(NAMES[rng] for rng in found)
            warnings.warn(
                f"fastloader: the dataset used {names} in a batch of samples {rest[:4]!r}... "
                f"after {self.memory.probed()} samples that did not: that batch was loaded "
                "again with every RNG seeded (NOTE [ Lazy seeding ]). If __getitem__ caches, "
                'counts or keeps its own state, pass seed_rngs="always".',
                RuntimeWarning,
                stacklevel=2,
            )
        return bool(found)
