"""The diagnosis: from one epoch's timings to the one change that would help.

Runs in the main (training) process, once per summary. ``EpochStats.next_step`` calls
``next_step(stats)``.

NOTE [ The diagnosis ]

A user reads one line and must know whether loading slows training and what to change. The
wait fraction counts every second the training loop was blocked on data (``iter()`` included,
the ``next()`` that ends the epoch included) over the epoch's wall time, from ``iter()`` to the
end. Below ``INPUT_BOUND_THRESHOLD`` the loader keeps up: the model is the bottleneck. Above
it, the wait is split into what the loader can tell apart and the one next step is chosen from
the largest part:

- the epoch start (worker start-up, the first batch): longer epochs, persistent workers;
- loading in the training process (``num_workers=0``): use workers;
- the device copy: pinned memory, smaller batches on the wire (uint8, not float32);
- waiting for workers while they are busy most of the time (``BUSY_WORKERS``): more workers,
  or cheaper samples (packed files, cheaper decoding and transforms);
- waiting for workers that are mostly idle: batches are slow to reach the training process
  (large Python objects pickled through the queue, an overloaded main process): return
  tensors, raise ``prefetch_factor``, or give the main process a CPU of its own.

How busy workers were is measured in the workers: each adds the seconds it spent in the
dataset for each task to its slot of a shared array (one ``perf_counter`` pair per batch);
``collate_fn`` and sending the batch are not counted. The share is those seconds over
``num_workers`` times the epoch's wall time. Iterable datasets report none.

NOTE [ Advice that changes the numbers ]
Advice the user already follows, or that cannot apply, teaches them to ignore the line. So the
diagnosis also knows the loader's settings (``stats/settings.py``: persistent workers, device,
pinning, usable CPUs, the dataset's size against the memory the page cache may use) and gives
only advice that would change the numbers, else says "nothing to change" and why:
- the epoch start with persistent workers, in the epoch that started them: paid once per
  loader, nothing to change; without persistent workers: turn them on; persistent workers already
  running: in a short epoch (``SHORT_EPOCH_BATCHES``) the start is a large share by nature,
  nothing to change; in a longer one the epoch may not have been loaded ahead (docs/loader.md);
- the device step: with ``device="cpu"`` nothing is copied, the time is ``device_transform``
  in the training process (move it to the dataset) or the step itself (leave ``device`` out);
  on a GPU batches are already pinned and copied on a side stream: fewer bytes per batch
  (uint8, normalised on the GPU with ``device_transform`` unless it already is);
- busy workers that already use every CPU but the training process's: not "add workers" but
  cheaper samples;
- idle workers whose batches cost less to load than to hand over (``CHEAP_BATCH_S``), with
  the default collate (the workers' busy time leaves the collate out): not "raise
  prefetch_factor" but ``num_workers=0``; and with ``num_workers=0``, batches that
  load faster than a worker's would be received (``HANDOVER_S``): nothing to change (not
  "add workers", which would send the user back);
- readers waiting for shard downloads (a ``ShardedDataset`` of a URL): the one option that
  changes that wait (shard size, ``cache_limit``, ``ahead``), NOTE [ Download stats ] in
  stats/downloads.py;
- reads from storage of data that fits in the page cache (``formats.advice.fits_in_memory``):
  a first read, nothing to change; only data bigger than that memory gets "does not fit".
Without settings (``timed_iter`` over another loader) the advice is the general one.
"""

from __future__ import annotations

from typing import Any

from fastloader.formats.advice import fits_in_memory
from fastloader.stats.downloads import download_advice

#: Training is called input-bound when it waits for data more than this fraction of an epoch.
INPUT_BOUND_THRESHOLD = 0.10
#: Workers busier than this share of their time cannot load faster: add workers.
BUSY_WORKERS = 0.80
#: What handing a batch over from a worker costs, about: 0.04-0.07 ms of the training
#: process's CPU to receive it (0.06-0.10 ms where batches travel one per message: NOTE
#: [ Batches per message ]) and 0.06-0.1 ms of the worker's beyond the loading (the 2-core
#: box: benchmarks/results/transport-0w-full.md, transport-groups-full.md): a batch that
#: loads in the training process (collate and loop included) faster than this is as fast or
#: faster there (pose fields, 0.1 ms a batch of 64: 2 workers 0.88-1.17x; an index, 0.08 ms
#: a batch of 256: about 0.67x).
HANDOVER_S = 0.15e-3
#: Workers that spend less than this in the dataset per batch: cheaper in the training
#: process. Lower than ``HANDOVER_S`` by the collate and the loop, which workers' busy time
#: leaves out, so that following the advice does not get "set num_workers > 0" back.
CHEAP_BATCH_S = 0.1e-3
#: An epoch of fewer batches than this pays its start (iter(), the first batch) over too few
#: batches to tell a slow start from a short epoch: nothing to change.
SHORT_EPOCH_BATCHES = 20


def next_step(stats: Any) -> str:
    """The one change an ``EpochStats``' numbers support, or "nothing to change". See NOTE [ The
    diagnosis ] and NOTE [ Advice that changes the numbers ]."""
    if stats.batches == 0:
        if stats.complete:
            return "the epoch had no batches: is the dataset (or this rank's shard) empty?"
        return "no batch was taken from this epoch yet"
    if not stats.input_bound:
        return "nothing to change: the loader keeps up; the model is the bottleneck, not data"
    settings = getattr(stats, "settings", None)
    downloads = getattr(stats, "downloads", None)
    advice = None if downloads is None else download_advice(stats, downloads)
    if advice is not None:  # NOTE [ Download stats ] in stats/downloads.py
        return advice
    if stats.io_note is not None:
        return _io_advice(stats, settings)
    parts = {
        "start": stats.start_wait_s,
        "device": stats.device_wait_s,
        "workers": stats.worker_wait_s,
    }
    largest = max(parts, key=parts.__getitem__)
    if largest == "device":
        return _device_advice(settings)
    if stats.workers == 0:
        load_s = stats.wait_s / stats.batches
        if load_s < HANDOVER_S:  # workers would cost the training process more
            return (
                f"nothing to change: a batch loads in {1000 * load_s:.2f} ms in the training "
                f"process, less than receiving it from a worker would cost it (about "
                f"{1000 * HANDOVER_S:.2f} ms)"
            )
        return "samples are loaded in the training process: set num_workers > 0"
    if largest == "start":
        return _start_advice(stats, settings)
    return _worker_advice(stats, settings)


def _start_advice(stats: Any, settings: Any) -> str:
    if settings is None:
        return (
            "most of the wait is the epoch's start (worker start-up, first batch): keep "
            "workers persistent and the loader alive across epochs"
        )
    if not settings.persistent_workers:
        return (
            "most of the wait is the epoch's start: workers start again every epoch "
            "(persistent_workers=False): set persistent_workers=True (fastloader's default)"
        )
    if stats.worker_startup_s > 0:
        return (
            f"nothing to change: most of the wait is starting {stats.workers} workers, once "
            "per loader (persistent workers); later epochs of this loader skip it"
        )
    if stats.batches < SHORT_EPOCH_BATCHES:
        return (
            f"nothing to change: in an epoch of {stats.batches} batches its start (iter() and "
            f"the first batch, {1000 * stats.start_wait_s:.0f} ms) is a large share; it does "
            "not grow with the epoch"
        )
    return (
        "most of the wait is the epoch's start, with the workers already running: the epoch "
        "may not have been loaded ahead (see 'When the next epoch cannot be prefetched' in "
        "docs/loader.md)"
    )


def _device_advice(settings: Any) -> str:
    if settings is None or settings.device_type is None:
        return (
            "most of the wait is the copy to the device: use pinned memory "
            "(pin_memory=True) and send compact dtypes (uint8 images, normalise on device)"
        )
    if settings.device_type == "cpu":
        if settings.device_transform:
            return (
                "most of the wait is device_transform, which runs in the training process "
                "with device='cpu': apply it in the dataset, where the workers run it"
            )
        return (
            "most of the wait is the device step, and device='cpu' copies nothing: leave "
            "device= out"
        )
    compact = "send fewer bytes per batch (uint8 rather than float, smaller images)"
    if not settings.device_transform:
        compact = (
            "send uint8 batches and normalise on the GPU "
            "(device_transform=fastloader.Normalize(...))"
        )
    return (
        "most of the wait is the copy to the device, already from pinned memory on a side "
        f"stream: {compact}"
    )


def _worker_advice(stats: Any, settings: Any) -> str:
    busy = stats.worker_busy_fraction
    if busy is None:
        return "loading is slower than training: add workers or make samples cheaper"
    cheaper = "make samples cheaper (pack the data, cheaper decoding and transforms)"
    if busy >= BUSY_WORKERS:
        cpus = getattr(settings, "cpus", None)
        if cpus is not None and stats.workers >= cpus - 1:
            return (
                f"workers are busy {100 * busy:.0f}% of the time and {stats.workers} of them "
                f"already use this machine's {cpus} CPUs (one is training's): {cheaper}; more "
                "workers would share the same CPUs"
            )
        return f"workers are busy {100 * busy:.0f}% of the time: add workers or {cheaper}"
    load_s = busy * stats.workers * stats.wall_s / stats.batches  # per batch, in the workers
    collate_is_cheap = settings is not None and settings.default_collate  # not in busy time
    if load_s < CHEAP_BATCH_S and collate_is_cheap:
        return (
            f"workers load a batch in {1000 * load_s:.2f} ms, less than handing it to the "
            f"training process costs it (about {1000 * HANDOVER_S:.2f} ms): num_workers=0 "
            "loads such batches as fast or faster"
        )
    return (
        f"workers are busy only {100 * busy:.0f}% of the time, yet training waits: batches "
        "are slow to reach the training process (return tensors, not Python objects; "
        "raise prefetch_factor; leave the training process a CPU of its own)"
    )


def _io_advice(stats: Any, settings: Any) -> str:
    data = getattr(settings, "data_bytes", None)
    memory = getattr(settings, "memory_bytes", None)
    if data is None or memory is None or not fits_in_memory(data, memory):
        return stats.io_note  # the data does not fit in memory (see stats/io_probe.py)
    return (
        f"nothing to change: the data ({_size(data)}) was read from storage, not the page "
        f"cache, and fits in memory ({_size(memory)} available): later epochs read it from "
        "memory unless other programs need that memory"
    )


def _size(nbytes: float) -> str:
    """``1.1 MB``, ``18.0 GB``: decimal units, as ``df -H`` prints them."""
    for unit in ("bytes", "KB", "MB"):
        if nbytes < 1000:
            return f"{nbytes:.0f} bytes" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} GB"
