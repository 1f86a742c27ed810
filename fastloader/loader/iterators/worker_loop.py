"""Inside torch's worker loop: its task queue read through ``BufferedGet``.

Runs in each worker, called by ``WorkerInit`` (loader/worker_guard.py), which torch's
``_utils.worker._worker_loop`` calls as ``init_fn(worker_id)`` before its loop starts. This
reaches into that function's frame for its ``index_queue`` local (NOTE [ torch internals
fastloader relies on ] in __init__.py; tests/test_pipes.py checks it is found).
"""

from __future__ import annotations

import sys

from torch.utils.data._utils import worker

from fastloader.loader.transport.pipes import BufferedGet, reads_directly

_FRAMES_UP = 8  # how far above this function the worker loop's frame may be


def read_tasks_directly() -> bool:
    """Give the calling worker loop's task queue a ``get`` that reads every task already in
    the pipe at once (NOTE [ Puts without a feeder thread ], "Reading tasks"); whether it
    did (False where the loop or its local is not found, or off Linux)."""
    if not reads_directly():
        return False
    frame = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return False
        if frame.f_code is worker._worker_loop.__code__:
            queue = frame.f_locals.get("index_queue")
            if queue is None or not hasattr(queue, "_reader"):
                return False
            queue.get = BufferedGet(queue)
            return True
        frame = frame.f_back
    return False
