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
"""

from __future__ import annotations

from typing import Any

#: Training is called input-bound when it waits for data more than this fraction of an epoch.
INPUT_BOUND_THRESHOLD = 0.10
#: Workers busier than this share of their time cannot load faster: add workers.
BUSY_WORKERS = 0.80


def next_step(stats: Any) -> str:
    """The one change an ``EpochStats``' numbers support. See NOTE [ The diagnosis ]."""
    if stats.batches == 0:
        if stats.complete:
            return "the epoch had no batches: is the dataset (or this rank's shard) empty?"
        return "no batch was taken from this epoch yet"
    busy = stats.worker_busy_fraction
    if not stats.input_bound:
        return "the loader keeps up: the model is the bottleneck, not data loading"
    if stats.io_note is not None:
        return stats.io_note  # the data does not fit in memory (see stats/io_probe.py)
    parts = {
        "start": stats.start_wait_s,
        "device": stats.device_wait_s,
        "workers": stats.worker_wait_s,
    }
    largest = max(parts, key=parts.__getitem__)
    if largest == "start":
        return (
            "most of the wait is the epoch's start (worker start-up, first batch): keep "
            "workers persistent and the loader alive across epochs"
        )
    if largest == "device":
        return (
            "most of the wait is the copy to the device: use pinned memory "
            "(pin_memory=True) and send compact dtypes (uint8 images, normalise on device)"
        )
    if stats.workers == 0:
        return "samples are loaded in the training process: set num_workers > 0"
    if busy is None:
        return "loading is slower than training: add workers or make samples cheaper"
    if busy >= BUSY_WORKERS:
        return (
            f"workers are busy {100 * busy:.0f}% of the time: add workers or make samples "
            "cheaper (pack the data, cheaper decoding and transforms)"
        )
    return (
        f"workers are busy only {100 * busy:.0f}% of the time, yet training waits: batches "
        "are slow to reach the training process (return tensors, not Python objects; "
        "raise prefetch_factor; leave the training process a CPU of its own)"
    )
