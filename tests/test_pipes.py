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


# -- NOTE [ Puts without a feeder thread ], "Reading tasks": BufferedGet ----------------------


def _reader(queue):
    return pipes.BufferedGet(queue)


def test_buffered_get_reads_every_message_in_order_and_keeps_the_count():
    queue = _queue()
    get = _reader(queue)
    big = np.arange(100_000, dtype=np.int64)  # 800 KB: goes by the feeder, in many reads
    for number in range(50):
        queue.put((number, list(range(number))))
    queue.put((50, big))
    queue.put((51, None))
    received = [get(timeout=5) for _ in range(52)]
    assert [number for number, _ in received] == list(range(52))
    assert received[7][1] == list(range(7))
    assert np.array_equal(received[50][1], big)
    assert queue._sem.get_value() == queue._maxsize  # each get released what put took


def test_buffered_get_times_out_and_raises_empty_like_queue_get():
    import queue as queue_module
    import time

    get = _reader(_queue())
    with pytest.raises(queue_module.Empty):
        get(block=False)
    started = time.monotonic()
    with pytest.raises(queue_module.Empty):
        get(timeout=0.2)
    assert 0.15 < time.monotonic() - started < 30  # waited the timeout, did not ignore it


def test_buffered_get_raises_eof_when_every_writer_is_gone():
    queue = multiprocessing.get_context("fork").Queue()
    get = _reader(queue)
    queue._writer.close()
    with pytest.raises(EOFError):
        get(timeout=5)


def test_buffered_get_completes_a_message_split_across_reads():
    import queue as queue_module

    queue = _queue()
    get = _reader(queue)
    message = pipes.dumps((3, "x" * 100))
    framed = len(message).to_bytes(4, "big") + bytes(message)
    import os

    os.write(queue._writer.fileno(), framed[:7])  # length and 3 bytes: the rest comes later
    queue._sem.acquire()
    with pytest.raises(queue_module.Empty):  # nothing whole yet
        get(block=False)
    os.write(queue._writer.fileno(), framed[7:])
    assert get(timeout=5) == (3, "x" * 100)


def test_dumps_pickles_with_forking_reducers_registered_later():
    # a reducer registered after the first message is used from the next message on
    from multiprocessing.reduction import ForkingPickler

    class Special:
        pass

    assert pipes.dumps((1, [2])) is not None
    ForkingPickler.register(Special, lambda obj: (str, ("reduced",)))
    try:
        import pickle

        assert pickle.loads(pipes.dumps(Special())) == "reduced"
    finally:
        del ForkingPickler._extra_reducers[Special]


class _ReadsTasksDirectly(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        from fastloader.loader import worker_guard

        return worker_guard.tasks_read_directly


@pytest.mark.parametrize("start", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_workers_read_their_tasks_through_buffered_get(start):
    # guards the reach into torch's worker loop (iterators/worker_loop.py): its frame and its
    # index_queue local are found in every worker, under each start method
    loader = DataLoader(
        _ReadsTasksDirectly(),
        batch_size=2,
        num_workers=2,
        seed=0,
        multiprocessing_context=start,
    )
    try:
        assert [flag for batch in loader for flag in batch.tolist()] == [True] * 8
    finally:
        loader.close()


def test_dumps_uses_a_reducer_registered_again_for_the_same_type():
    import pickle
    from multiprocessing.reduction import ForkingPickler

    class Special:
        pass

    ForkingPickler.register(Special, lambda obj: (str, ("first",)))
    try:
        assert pickle.loads(pipes.dumps(Special())) == "first"
        ForkingPickler.register(Special, lambda obj: (str, ("second",)))  # same table size
        assert pickle.loads(pipes.dumps(Special())) == "second"
    finally:
        del ForkingPickler._extra_reducers[Special]
