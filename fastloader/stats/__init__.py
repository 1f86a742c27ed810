"""Where the time goes: how long training waited for data, and what to change about it.

Runs in the main (training) process. ``timing.py`` (LoaderStats, timed_iter: the per-batch
clock), ``epoch.py`` (EpochStats: one epoch's figures), ``diagnosis.py`` (NOTE [ The diagnosis ]:
figures -> the one next step), ``settings.py`` (the loader's settings the advice depends on),
``batch_size.py`` (samples in a batch), ``io_probe.py`` (bytes a process read from storage),
``downloads.py`` (NOTE [ Download stats ]: an epoch's shard downloads, waits and requests).

May import: the standard library, torch, and of fastloader only ``formats/`` (the memory the
page cache may use).
"""

from fastloader.stats.batch_size import batch_size
from fastloader.stats.diagnosis import BUSY_WORKERS, INPUT_BOUND_THRESHOLD
from fastloader.stats.epoch import EpochStats
from fastloader.stats.timing import LoaderStats, timed_iter

__all__ = [
    "BUSY_WORKERS",
    "EpochStats",
    "INPUT_BOUND_THRESHOLD",
    "LoaderStats",
    "batch_size",
    "timed_iter",
]
