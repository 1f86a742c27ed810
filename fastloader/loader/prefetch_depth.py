"""How many batches each worker loads ahead when the user left ``prefetch_factor`` unset.

NOTE [ Prefetch depth by batch bytes ]

torch keeps ``prefetch_factor`` (default 2) tasks per worker in flight and sends a new one only
when the batch due next is handed out. On a machine whose cores the workers share with the
training process, a worker descheduled for a moment holds up the batch due next, and the other
workers, their two tasks done, wait idle for new ones. For cheap batches a deeper queue keeps
them busy: with 2 workers on the 2-core box the depth below gave 1.08-1.22x the samples/s of
torch's 2 (pose HDF5 batches of 64 1.22x, token windows 1.13x, an index dataset 1.08x,
3x224x224 uint8 images at depth 3 1.22x) and up to a fifth less of the main process's CPU per
batch (fewer wake-ups; benchmarks/results/transport-depth-full.md).

What that costs is memory: each batch in flight is a region of the worker's shared-memory slot
(NOTE [ Batch transport ]). So when ``prefetch_factor`` is not given, fastloader starts with
torch's 2 and, once the first batch arrives, keeps ``PREFETCH_BYTES`` of batches in flight per
worker: ``PREFETCH_BYTES // batch bytes``, at least 2 (torch's default) and at most
``MAX_DEPTH``. Batches of 340 KB (pose) or 1 MB (token windows) get 8; 9.6 MB of images get 3;
a 150 MB float batch keeps 2, and so does a batch whose tensors sit inside objects other than
lists, tuples and mappings (their bytes are not seen). The first batch stands for the others:
batches that grow later (lengths bucketed by size) keep its depth. A ``prefetch_factor`` the
user gives is kept as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: Bytes of batches in flight per worker that the depth aims at (see the NOTE).
PREFETCH_BYTES = 32 << 20
#: The deepest queue per worker: past it the measured gain was gone.
MAX_DEPTH = 8
TORCH_DEPTH = 2  # torch's default prefetch_factor
_MAX_LEAVES = 10_000  # a batch of more array leaves is not walked further


def prefetch_depth(batch: Any) -> int:
    """Batches in flight per worker for batches like ``batch`` (see the NOTE); torch's 2 for
    a batch whose tensors it cannot see (inside objects of other kinds)."""
    size = batch_bytes(batch)
    if size == 0:
        return TORCH_DEPTH
    return max(TORCH_DEPTH, min(MAX_DEPTH, PREFETCH_BYTES // size))


def batch_bytes(batch: Any) -> int:
    """The bytes of the tensors and arrays in ``batch`` (lists, tuples and mappings walked;
    what other objects hold is not counted)."""
    total = 0
    pending = [batch]
    seen = 0
    while pending and seen < _MAX_LEAVES:
        value = pending.pop()
        seen += 1
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, Mapping):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return total
