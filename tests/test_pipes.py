"""NOTE [ Puts without a feeder thread ]: queue puts written in the calling thread never block,
never reorder, and hand what does not fit to the feeder thread."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastloader import DataLoader
from fastloader.loader.transport import pipes

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pipe room is read on Linux")


def _queue():
    queue = multiprocessing.get_context("fork").Queue()
    assert pipes.write_directly(queue)
    return queue


def test_small_messages_are_written_without_a_feeder_thread():
    queue = _queue()
    for number in range(100):
        queue.put((number, list(range(64))))
    assert queue._thread is None  # no feeder thread was started
    assert [queue.get(timeout=5)[0] for _ in range(100)] == list(range(100))


def test_a_full_pipe_never_blocks_and_order_is_kept():
    # nobody reads (a dead worker): the puts that do not fit go to the feeder thread, and so
    # does everything after them, so the reader still gets every message in order
    queue = _queue()
    big = np.arange(4000, dtype=np.int64)  # 32 KB pickled: the pipe (64 KB) fills at once
    for number in range(6):
        queue.put((number, big))
    queue.put((6, None))
    assert queue.put._fed  # the rest went to the feeder thread
    received = [queue.get(timeout=5) for _ in range(7)]
    assert [number for number, _ in received] == list(range(7))
    assert all(np.array_equal(array, big) for _, array in received[:6])


def test_many_small_messages_nobody_reads_never_block():
    # a pipe of 64 KB blocked a 200-byte write with 64,000 bytes unread (pages, not bytes):
    # run in a child, so a hang is seen as one
    script = (
        "import multiprocessing, sys\n"
        "from fastloader.loader.transport import pipes\n"
        "queue = multiprocessing.get_context('fork').Queue()\n"
        "assert pipes.write_directly(queue)\n"
        "for number in range(2000):\n"
        "    queue.put((number, list(range(40))))\n"
        "assert queue.put._fed\n"
        "assert [queue.get(timeout=5)[0] for _ in range(2000)] == list(range(2000))\n"
        "print('ORDERED')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "ORDERED" in run.stdout, run.stderr[-2000:]


def test_a_tensor_that_goes_to_the_feeder_is_pickled_once():
    queue = _queue()
    queue.put(b"x" * 60_000)  # leaves no room
    tensor = torch.arange(10_000)
    queue.put(tensor)  # pickled here, sent by the feeder as those bytes
    assert len(queue.get(timeout=5)) == 60_000
    assert torch.equal(queue.get(timeout=5), tensor)


def test_the_loaders_queues_write_directly_and_batches_are_right():
    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, seed=0)
    try:
        assert [batch.tolist() for batch in loader] == [
            list(range(i, i + 4)) for i in range(0, 64, 4)
        ]
        iterator = loader._iterator
        assert all(isinstance(queue.put, pipes.DirectPut) for queue in iterator._index_queues)
        assert iterator._worker_init_fn.result_queue is iterator._worker_result_queue
    finally:
        loader.close()


class _Threads(torch.utils.data.Dataset):
    """Each sample: whether this process runs a queue feeder thread while it loads."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        import threading

        return any(thread.name == "QueueFeederThread" for thread in threading.enumerate())


def test_workers_send_results_without_a_feeder_thread():
    # the first result of each worker went out before these samples load: had it gone through
    # the queue's feeder, that thread would be running in the worker now
    loader = DataLoader(_Threads(), batch_size=2, num_workers=2, seed=0)
    try:
        assert not any(flag for batch in loader for flag in batch.tolist())
    finally:
        loader.close()
