"""A worker killed while writing a result through the pipe: no hang, the epoch is whole.

See NOTE [ Torn results ] in fastloader/loader/result_queue.py. Each scenario runs in its own
process with a time limit, so a hang is seen as a failure, not a stuck suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCENARIO = textwrap.dedent(
    """
    import os, signal, sys, warnings
    from multiprocessing.connection import Connection

    import torch
    from torch.utils.data import Dataset, IterableDataset, get_worker_info

    import fastloader

    MARKER = sys.argv[1]
    KIND = sys.argv[2]
    SIZE = 300_000  # bytes: travels through the pipe in many writes


    def payload(index):
        return bytes([index % 251]) * SIZE


    def die_halfway_through_the_next_big_write():
        if os.path.exists(MARKER):
            return
        open(MARKER, "w").close()
        send = Connection._send

        def torn_send(self, buf, *args):
            if len(buf) >= SIZE:
                send(self, bytes(memoryview(buf)[: len(buf) // 2]))
                os.kill(os.getpid(), signal.SIGKILL)
            return send(self, buf, *args)

        Connection._send = torn_send


    class Bytes(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, index):
            if index == 5:
                die_halfway_through_the_next_big_write()
            return payload(index)


    class Stream(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            for index in range(info.id, 12, info.num_workers):
                if index == 5:
                    die_halfway_through_the_next_big_write()
                yield payload(index)


    def collate(batch):
        return batch[0]


    if KIND == "map":
        loader = fastloader.DataLoader(
            Bytes(), batch_size=1, num_workers=2, collate_fn=collate, seed=0
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(loader)
        assert got == [payload(i) for i in range(12)], "an epoch with a torn result differs"
        deaths = [w for w in caught if "died" in str(w.message) or "killed" in str(w.message)]
        assert deaths, [str(w.message) for w in caught]
        print("WHOLE EPOCH")
    else:
        loader = fastloader.DataLoader(Stream(), batch_size=1, num_workers=2, collate_fn=collate)
        try:
            list(loader)
        except RuntimeError as error:
            print("RAISED", error)
    loader.close() if hasattr(loader, "close") else None
    """
)


def _run(tmp_path: Path, kind: str) -> subprocess.CompletedProcess:
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "marker"), kind],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the torn write is staged with Linux pipes")
def test_a_worker_killed_mid_message_is_replaced_and_the_epoch_is_whole(tmp_path):
    run = _run(tmp_path, "map")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WHOLE EPOCH" in run.stdout
    assert (tmp_path / "marker").exists()  # the worker really died mid-message


@pytest.mark.skipif(sys.platform != "linux", reason="the torn write is staged with Linux pipes")
def test_an_unsupervised_pool_raises_torchs_error_instead_of_hanging(tmp_path):
    run = _run(tmp_path, "iterable")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "RAISED" in run.stdout and "exited unexpectedly" in run.stdout, run.stdout


_KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, signal, sys, time, warnings

    import torch
    from torch.utils.data import Dataset

    import fastloader

    WORKERS = int(sys.argv[1])
    IMAGE = 786_432  # bytes: a 512x512x3 image packed raw, read as bytes


    class RawImages(Dataset):  # bytes through the pipe, labels as tensors (shared by fd)
        def __len__(self):
            return 64

        def __getitem__(self, index):
            return bytes([index % 251]) * IMAGE, torch.tensor(index)


    loader = fastloader.DataLoader(
        RawImages(), batch_size=16, num_workers=WORKERS, timeout=10, seed=0
    )
    labels = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step, (images, batch_labels) in enumerate(loader):
            assert all(len(image) == IMAGE for image in images)
            labels += batch_labels.tolist()
            if step == 0:
                time.sleep(0.5)  # the workers' next 12 MB batch fills the pipe and blocks
                os.kill(loader._iterator.worker_pids[0], signal.SIGKILL)
            time.sleep(0.2)
    assert labels == list(range(64)), labels
    print("WHOLE EPOCH")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL and Linux pipes")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_killed_while_writing_a_large_batch_never_hangs_the_loop(tmp_path, workers):
    # issue 27: the resource sharer thread's small messages lowered the writer's mark
    script = tmp_path / "killed_mid_write.py"
    script.write_text(_KILLED_MID_WRITE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(script), str(workers)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WHOLE EPOCH" in run.stdout


_STALLS_MID_WRITE = textwrap.dedent(
    """
    import os, sys, time
    from multiprocessing.connection import Connection

    from torch.utils.data import Dataset

    import fastloader

    SIZE = 300_000  # bytes: travels through the pipe in many writes


    def stall_halfway_through_the_next_big_write():
        send = Connection._send

        def stalled_send(self, buf, *args):
            if len(buf) >= SIZE:
                send(self, bytes(memoryview(buf)[: len(buf) // 2]))
                time.sleep(3600)  # alive, never finishing the message
            return send(self, buf, *args)

        Connection._send = stalled_send


    class Bytes(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            if index == 3:
                stall_halfway_through_the_next_big_write()
            return bytes([index]) * SIZE


    loader = fastloader.DataLoader(
        Bytes(), batch_size=1, num_workers=1, collate_fn=lambda b: b[0], timeout=3
    )
    started = time.monotonic()
    try:
        list(loader)
    except RuntimeError as error:
        print("TIMED OUT", round(time.monotonic() - started), str(error)[:200])
    os._exit(0)  # the stalled worker is killed with this process
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="the stalled write is staged with Linux pipes")
def test_timeout_fires_while_a_live_worker_leaves_a_message_half_written(tmp_path):
    script = tmp_path / "stalls_mid_write.py"
    script.write_text(_STALLS_MID_WRITE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TIMED OUT" in run.stdout, run.stdout


# -- the reader's buffer: several results per read, a torn tail dropped ----------------------


def _guarded_queue(writer_died):
    import multiprocessing

    from fastloader.loader.result_queue import guard_reads

    queue = multiprocessing.get_context("fork").Queue()
    reader = guard_reads(queue, [], [])
    reader._writer_died = writer_died
    return queue, reader


def _send(queue, obj):  # as a put would, the bytes written here
    import pickle

    queue._sem.acquire()
    queue._writer.send_bytes(pickle.dumps(obj))


@pytest.mark.skipif(sys.platform != "linux", reason="pipes read as on Linux")
def test_results_that_arrived_together_are_read_at_once_and_in_order():
    queue, reader = _guarded_queue(lambda: False)
    for number in range(5):
        _send(queue, b"%d" % number * 100)
    assert queue.get(timeout=5) == b"0" * 100
    assert not reader._poller.poll(0)  # the pipe is empty: the rest is in the buffer
    assert not queue.empty()  # and the queue's own poll sees it
    assert [queue.get(timeout=5) for _ in range(4)] == [b"%d" % n * 100 for n in range(1, 5)]
    assert queue.empty()


@pytest.mark.skipif(sys.platform != "linux", reason="pipes read as on Linux")
def test_a_torn_message_after_whole_ones_is_dropped_and_the_whole_ones_kept():
    import queue as queue_module

    dead = [False]
    queue, reader = _guarded_queue(lambda: dead[0])
    _send(queue, b"whole")
    message = b"torn" * 100
    queue._sem.acquire()
    os.write(queue._writer.fileno(), len(message).to_bytes(4, "big") + message[:50])
    assert queue.get(timeout=5) == b"whole"
    with pytest.raises(queue_module.Empty):  # a live writer: the partial is kept, not waited on
        queue.get(timeout=0.2)
    dead[0] = True
    reader.drop_torn()  # as the pool does before it replaces the dead worker
    queue._sem.release()  # the torn message's count
    _send(queue, b"next")  # the pipe is at the start of a message again
    assert queue.get(timeout=5) == b"next"


@pytest.mark.skipif(sys.platform != "linux", reason="pipes read as on Linux")
def test_a_large_result_is_read_whole_and_a_torn_large_one_dropped():
    import queue as queue_module
    import threading

    dead = [False]
    queue, reader = _guarded_queue(lambda: dead[0])
    big = bytes(range(256)) * 4000  # 1 MB: many reads, its body read straight into its buffer
    writer = threading.Thread(target=_send, args=(queue, big))
    writer.start()
    assert queue.get(timeout=5) == big
    writer.join()
    # a large message cut short by its writer's death: dropped, and the next one is whole
    message = b"x" * 200_000
    queue._sem.acquire()
    os.write(queue._writer.fileno(), len(message).to_bytes(4, "big") + message[:30_000])
    with pytest.raises(queue_module.Empty):
        queue.get(timeout=0.2)
    assert reader._framed.room() is not None  # reading the body into its own buffer
    dead[0] = True
    reader.drop_torn()
    queue._sem.release()
    _send(queue, b"after")
    assert queue.get(timeout=5) == b"after"


@pytest.mark.skipif(sys.platform != "linux", reason="pipes read as on Linux")
def test_queue_empty_from_another_thread_while_results_are_read_never_raises():
    import threading

    queue, _ = _guarded_queue(lambda: False)
    count = 300
    errors = []

    def read():
        for _ in range(count):
            queue.get(timeout=5)

    reader = threading.Thread(target=read)
    reader.start()
    for number in range(count):
        _send(queue, number)
        try:
            queue.empty()  # the queue's poll, without its read lock, while the reader polls
        except Exception as error:  # noqa: BLE001 - any error is the failure
            errors.append(error)
    reader.join(timeout=30)
    assert not errors and not reader.is_alive()
