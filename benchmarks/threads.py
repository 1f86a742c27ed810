"""Threads or processes: a thread pool loader against fastloader's workers (issue 30).

Issue 30 asks where worker threads beat worker processes (work that releases the GIL: gathers
from packs, JPEG decoding). Each data kind runs through:

- ``fastloader.DataLoader(ds, batch_size=B, shuffle=True, seed=0, num_workers=W)`` for W = 0
  (in the main process) and 2 (processes, persistent; batches through shared-memory slots);
- a thread pool loader written here (:class:`ThreadLoader`, not in the package): T threads
  (1, 2, 4) in the main process, each loading whole batches (``dataset.__getitems__`` if the
  dataset has it, else ``dataset[i]`` per sample, then fastloader's ``default_collate``), at
  most 2 batches per thread in flight, delivered in sampler order; persistent threads, a
  shuffled order from its own NumPy generator, and no RNG seeding (a real thread mode cannot
  seed the process-global RNGs per sample while the training thread and the other loading
  threads draw from them: a design constraint, not a shortcut);
- ``plain_loop``: the thread loader's loop run in the consuming thread (no threads, no
  seeding): what separates the threads' gain from fastloader's own cost per batch at W = 0.

The loaders take turns epoch by epoch (interleaved rounds, after a warm-up epoch that starts
the workers or threads); each ratio is the median of the per-round ratios of samples/s. The
rate is steady: from the end of each epoch's first ``SKIP_BATCHES`` batches to its last batch.
fastloader's persistent 2-process pool runs an untimed epoch right before each timed one (see
NOTE [ A pool that loads ahead ]). Also per loader: the process's CPU time and minor page
faults per batch (``time.process_time``, ``getrusage``: the main process, all its threads, so
the thread loader's loading threads count and fastloader's worker processes do not).

- ``pose64``: benchmarks/any_sample.py's pose-style HDF5 file read in place by ``HDF5Dataset``
  (mapped rows: NumPy gathers), batch 64;
- ``tokens``: 2048-token windows and targets from a uint16 memmap (benchmarks/cheap.py), batch
  32;
- ``index``: ``dataset[i]`` returns ``i``, batch 256;
- ``images``: a 3x224x224 uint8 tensor per sample (benchmarks/transport.py's), batch 64;
- ``jpeg256``: the photos (``_photos.py``) in an LMDB pack (``--store jpeg``, short side 256),
  decoded by the fused random-resized crop 224 + flip (libjpeg-turbo via simplejpeg and
  OpenCV's resize, both releasing the GIL), batch 64: pipeline.py's ``lmdb_jpeg_fused``;
- ``jpeg_encoded``: the same photos as they were (~500x375 JPEGs, ``--store encoded``), the
  same fused transform (more of each sample's time is decoding): ``lmdb_encoded_fused``.

Run alone: ``python -m benchmarks --only threads``.
"""

from __future__ import annotations

import collections
import resource
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks._photos import image_folder, packed
from benchmarks._progress import advance, note, plan
from benchmarks._stats import paired_ratio, rotated, significant
from benchmarks.any_sample import make_pose_file
from benchmarks.cheap import IndexDataset, TokenWindows, _token_file
from benchmarks.pipeline import train_transform
from benchmarks.transport import Images
from fastloader import DataLoader, HDF5Dataset, LMDBDataset
from fastloader.datasets.collate import default_collate

SIZES = {
    #       rounds, pose samples, token windows, index samples, images, photos
    "tiny": (1, 2048, 512, 16_384, 512, 384),
    "quick": (7, 16_384, 8192, 131_072, 4096, 1280),
    "full": (9, 32_768, 16_384, 262_144, 8192, 2560),
}
BATCHES = {
    "pose64": 64,
    "tokens": 32,
    "index": 256,
    "images": 64,
    "jpeg256": 64,
    "jpeg_encoded": 64,
}
THREAD_COUNTS = (1, 2, 4)
PREFETCH = 2  # batches in flight per thread
SKIP_BATCHES = 5  # fastloader's 2 workers x prefetch 2 loaded ahead, + 1
PROC0, PROC2, PLAIN = "fastloader_0w", "fastloader_2proc", "plain_loop"
WIN, LOSE = 1.05, 0.95  # a verdict needs the median ratio past these ...
AGREE = 0.8  # ... and this share of the rounds on the same side of 1


class ThreadLoader:
    """Batches loaded by ``threads`` threads of this process, in a shuffled order.

    Each thread loads whole batches (``__getitems__`` if the dataset has it, else one
    ``dataset[i]`` per sample) and collates them with fastloader's ``default_collate``. At most
    ``PREFETCH * threads`` batches are in flight (submitted as the consumer takes one: a
    bounded queue), and they come out in the order they were submitted. The threads persist
    across epochs; nothing is seeded (see the module docstring). ``threads=0``: the same loop
    in the consuming thread.

    Each loading thread runs torch's ops on one intra-op thread (``torch.set_num_threads(1)``
    there, as fastloader's worker processes do: OpenMP's count is per thread, so a consuming
    thread that has already run torch's ops keeps its own; torch also makes 1 the default of
    threads that have not, a trap for a real thread mode). Without it, on this box, once a
    loading thread had run torch's copies, the consuming thread's own batch copies
    (``images``: 64 clones and a stack of 9.6 MB) ran 6x slower, on one core (1.0 -> 6.7 ms a
    batch; perf: OpenMP futex wake-ups around ``direct_copy_kernel``), and the thread loader
    itself was slower.
    """

    def __init__(self, dataset: Any, batch: int, threads: int) -> None:
        self.dataset, self.batch, self.threads = dataset, batch, threads
        self.generator = np.random.default_rng(0)
        self.pool: ThreadPoolExecutor | None = None
        getitems = getattr(dataset, "__getitems__", None)
        self._read = getitems if callable(getitems) else self._each

    def _each(self, indices: list[int]) -> list:
        return [self.dataset[i] for i in indices]

    def _load(self, indices: list[int]) -> Any:
        return default_collate(self._read(indices))

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch)

    def __iter__(self) -> Any:
        if self.pool is None and self.threads:
            self.pool = ThreadPoolExecutor(
                self.threads, "loader", initializer=torch.set_num_threads, initargs=(1,)
            )
        order = self.generator.permutation(len(self.dataset))
        batches = (
            order[start : start + self.batch].tolist() for start in range(0, len(order), self.batch)
        )
        if not self.threads:  # the same loop in the consuming thread
            yield from map(self._load, batches)
            return
        pending: collections.deque[Future] = collections.deque()
        try:
            for indices in batches:
                pending.append(self.pool.submit(self._load, indices))
                if len(pending) >= PREFETCH * self.threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # an epoch left early: drop what was not started
                future.cancel()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


# NOTE [ A pool that loads ahead ]
# fastloader's persistent workers go on into the next epoch while the consumer has not asked
# for it (cross-epoch prefetch), several batches a message where samples are cheap: while the
# other loaders are timed, the 2-process pool may load its whole next epoch, and a short epoch
# (the tiny size) then "took" almost nothing (a ratio of 0.0 once rounded). So its timed epoch
# comes right after an untimed one of its own: what it loaded ahead was loaded while its own
# previous epoch ran, as in training, and the timed epoch runs at the pool's steady rate.
# Ratios are rounded to significant digits (_stats.significant), never to 0.


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _epoch(loader: Any, skip: int) -> tuple[float, float, int, int]:
    """Steady wall seconds, process CPU seconds, minor page faults (both for all its threads)
    and batches of one epoch: from the end of its first ``skip`` batches (what a persistent
    pool may have loaded ahead, across the epoch boundary, while another loader was timed) to
    its last batch."""
    started = cpu = 0.0
    batches = faults = 0
    for index, _ in enumerate(loader):
        if index == skip - 1:
            started, cpu, faults = time.perf_counter(), time.process_time(), _faults()
        elif index >= skip:
            batches += 1
    if batches == 0:
        raise ValueError(f"an epoch needs more than {skip} batches")
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return seconds, cpu, _faults() - faults, batches


def _loaders(dataset: Dataset, batch: int) -> dict[str, Any]:
    common: dict[str, Any] = dict(batch_size=batch, shuffle=True, seed=0)
    loaders: dict[str, Any] = {
        PROC0: DataLoader(dataset, num_workers=0, **common),
        PROC2: DataLoader(dataset, num_workers=2, **common),
    }
    loaders[PLAIN] = ThreadLoader(dataset, batch, 0)
    for threads in THREAD_COUNTS:
        loaders[f"threads_{threads}"] = ThreadLoader(dataset, batch, threads)
    return loaders


def _interleaved(
    kind: str, loaders: dict[str, Any], rounds: int, skip: int
) -> dict[str, list[tuple]]:
    """Per loader, ``(seconds, cpu seconds, batches)`` of each round (order rotated per round)."""
    for loader in loaders.values():  # warm-up: workers and threads started, pages cached
        _epoch(loader, skip)
    results: dict[str, list[tuple]] = {name: [] for name in loaders}
    names = list(loaders)
    for round_ in range(rounds):
        note(f"{kind}, round {round_ + 1} of {rounds}")
        for name in rotated(names, round_):
            if name == PROC2:  # NOTE [ A pool that loads ahead ]
                _epoch(loaders[name], skip)
            results[name].append(_epoch(loaders[name], skip))
        advance()
    return results


def _side(per_round: list[float]) -> str:
    """ "win" / "lose" / "tie" for the per-round ratios of samples/s (ours over theirs)."""
    ratio, above = statistics.median(per_round), sum(r > 1 for r in per_round)
    if ratio > WIN and above >= AGREE * len(per_round):
        return "win"
    if ratio < LOSE and len(per_round) - above >= AGREE * len(per_round):
        return "lose"
    return "tie"


def _verdict(seconds: dict[str, list[float]]) -> str:
    """One line: do the best threads beat the better fastloader setting, round after round;
    and do they beat the same loop without threads (parallelism, not bookkeeping)?"""
    base = min((PROC0, PROC2), key=lambda name: statistics.median(seconds[name]))
    threads = [name for name in seconds if name.startswith("threads_")]
    best = max(threads, key=lambda name: paired_ratio(seconds[base], seconds[name]))
    per_round = [b / t for b, t in zip(seconds[base], seconds[best], strict=True)]
    plain = [p / t for p, t in zip(seconds[PLAIN], seconds[best], strict=True)]
    side, plain_side = _side(per_round), _side(plain)
    word = {"win": "threads win", "lose": "threads lose", "tie": "no clear winner"}[side]
    if side == "win" and plain_side != "win":
        word = "threads win, but not by running in parallel"
    above = sum(r > 1 for r in per_round)
    return (
        f"{word}: the best, {best}, {statistics.median(per_round):.2f}x {base} (faster in "
        f"{above} of {len(per_round)} rounds), {statistics.median(plain):.2f}x the same loop "
        f"without threads ({plain_side})"
    )


def _compare(kind: str, dataset: Dataset, rounds: int, skip: int) -> tuple[list, dict, str]:
    batch = BATCHES[kind]
    loaders = _loaders(dataset, batch)
    try:
        results = _interleaved(kind, loaders, rounds, skip)
    finally:
        for loader in loaders.values():
            loader.close()
    seconds = {name: [r[0] for r in rounds_] for name, rounds_ in results.items()}
    steady = len(dataset) - skip * batch  # the samples after the first `skip` batches
    rows, ratios = [], {}
    for name, rounds_ in results.items():
        # samples/s ratio = inverse ratio of epoch times (same batches for every loader)
        vs = {base: paired_ratio(seconds[base], seconds[name]) for base in (PROC2, PROC0, PLAIN)}
        cpu = statistics.median(r[1] / r[3] for r in rounds_)
        faults = statistics.median(r[2] / r[3] for r in rounds_)
        rows.append(
            {
                "data": kind,
                "batch_size": batch,
                "loader": name,
                "samples_per_s": round(steady / statistics.median(seconds[name])),
                "process_cpu_ms_per_batch": significant(cpu * 1e3),
                "page_faults_per_batch": round(faults),
                **{f"vs_{base}": significant(ratio) for base, ratio in vs.items()},
            }
        )
        if name.startswith("threads_"):
            for base in (PROC2, PROC0):
                ratios[f"{kind}_{name}_vs_{base}"] = significant(vs[base])
    return rows, ratios, _verdict(seconds)


def _jpeg_pack(workdir: Path, photos: int, store: str) -> LMDBDataset:
    note(f"making {photos} photos and their LMDB pack (--store {store})")
    side = 256 if store == "jpeg" else None
    path = packed(image_folder(workdir, photos), workdir, "lmdb", store, side)
    return LMDBDataset(path, transform=train_transform())


def run(size: str, workdir: Path) -> dict:
    """Run the threads comparison at ``size`` ("tiny", "quick", "full")."""
    rounds, poses, windows, indices, images, photos = SIZES[size]
    skip = 2 if size == "tiny" else SKIP_BATCHES
    torch.manual_seed(0)
    datasets = {
        "pose64": lambda: HDF5Dataset(make_pose_file(workdir / f"pose-{poses}.h5", poses)),
        "tokens": lambda: TokenWindows(_token_file(workdir, windows), windows),
        "index": lambda: IndexDataset(indices),
        "images": lambda: Images(images),
        "jpeg256": lambda: _jpeg_pack(workdir, photos, "jpeg"),
        "jpeg_encoded": lambda: _jpeg_pack(workdir, photos, "encoded"),
    }
    plan(rounds * len(datasets))
    rows, ratios, verdicts = [], {}, []
    for kind, make in datasets.items():
        dataset = make()
        dataset[0]  # opened here, before any thread races to open it
        kind_rows, kind_ratios, verdict = _compare(kind, dataset, rounds, skip)
        rows += kind_rows
        ratios.update(kind_ratios)
        verdicts.append({"data": kind, "verdict": verdict})
    notes = [
        f"vs_*: the loader's samples/s over the named loader's, median of per-round ratios "
        f"({rounds} interleaved rounds after a warm-up epoch)",
        f"verdict: threads win (lose) where the best thread count's median ratio to the "
        f"faster fastloader setting is above {WIN} (below {LOSE}) and it is faster (slower) "
        f"in at least {AGREE:.0%} of the rounds; the same test against plain_loop says "
        "whether the threads' gain is parallelism or only the loop's lower cost per batch",
        f"samples/s, CPU and faults: steady, from the end of each epoch's first {skip} "
        f"batches; {PROC2}'s timed epoch follows an untimed one of its own (its workers load "
        "the next epoch ahead, up to all of it, while the other loaders are timed)",
        "process_cpu_ms_per_batch: time.process_time of the main process (all its threads: "
        "for threads_T it includes the loading threads; fastloader's worker processes are "
        "not counted) per batch, median over rounds; page_faults_per_batch: the same "
        "process's minor page faults (getrusage) per batch",
        "threads_T: T threads of the main process, whole batches each, 2 per thread in "
        "flight, sampler order, torch on 1 intra-op thread in each; no per-sample RNG "
        "seeding (a thread mode cannot seed the process-global RNGs per sample while the "
        "training thread uses them)",
    ]
    if rounds < 3:
        notes.append("one round: a smoke test; the verdicts need --size quick or full")
    return {
        "comparison": "threads",
        "config": {
            "rounds": rounds,
            "shuffle": True,
            "sizes": SIZES[size],
            "batches": BATCHES,
            "threads": THREAD_COUNTS,
            "prefetch_per_thread": PREFETCH,
            "main_thread_torch_threads": torch.get_num_threads(),
        },
        "rows": rows,
        "verdict_rows": verdicts,
        "ratios": ratios,
        "notes": notes,
    }
