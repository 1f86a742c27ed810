"""Worker results that a dead worker left half-written: found and dropped, never waited on.

NOTE [ Torn results ]

A worker sends each result through the pool's result queue, a pipe shared by all workers: a
4-byte length, then the pickled result (tensors travel through shared memory, anything else —
bytes, strings, NumPy arrays — through the pipe itself). A worker killed while writing (the
OOM killer, a segfault in another thread) leaves part of a message in the pipe, and Python's
``Connection.recv_bytes`` then waits forever for the rest: no death check or ``timeout=``
runs while the main process is blocked inside it.

Writers take the queue's write lock around each message, so at most one message is being
written at a time. Each worker raises its flag in a shared array while it writes a message
(``mark_writes``, installed in every worker at start-up), and the main process reads messages
with ``read_message`` (``guard_reads``), which never blocks for long: while a message is
incomplete it waits in short polls, and when no byte comes and the worker whose flag is up is
dead, the writer of this message is that worker (no one else could write while it held the
lock), so the partial message is dropped and the read answers "nothing yet" (``queue.Empty``).
The pipe is then at the start of the next message. torch's own death check then finds the
dead worker, and supervision replaces it and re-sends its tasks (NOTE [ Supervised workers ]
in loader/supervision.py); without supervision, torch's "worker exited unexpectedly" error
is raised.
The dead worker's flag is lowered when its replacement starts, after its write lock was
released (``release_orphaned_write_lock``).
"""

from __future__ import annotations

import os
import queue
import select
import struct
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

POLL_S = 0.05  # how long a read waits for more bytes before checking for a dead writer


def mark_writes(writing: Any, slot: int) -> None:
    """In a worker: raise ``writing[slot]`` while this process writes any message to a pipe.

    Patches ``Connection._send_bytes`` (looked up on each send, also by the queue's feeder
    thread) in this worker process only. See NOTE [ Torn results ].
    """
    original = Connection._send_bytes

    def send_bytes_marked(self: Connection, buf: Any) -> None:
        writing[slot] = 1
        try:
            original(self, buf)
        finally:
            writing[slot] = 0

    Connection._send_bytes = send_bytes_marked  # type: ignore[method-assign]


def guard_reads(result_queue: Any, writing: Any, workers: Sequence[Any]) -> None:
    """In the main process: read ``result_queue``'s messages with ``read_message``.

    Args:
        result_queue: the pool's multiprocessing result queue.
        writing: the shared flags that ``mark_writes`` raises, one per worker slot.
        workers: the pool's list of worker processes (updated in place as they are replaced).
    """

    def torn_writer_died() -> bool:
        for slot, flag in enumerate(writing):
            if flag and slot < len(workers) and not workers[slot].is_alive():
                return True
        return False

    reader = result_queue._reader
    poller = select.poll()  # made once: this runs for every result
    poller.register(reader.fileno(), select.POLLIN | select.POLLHUP)

    def recv_bytes() -> bytes | bytearray:
        return read_message(reader, torn_writer_died, poller)

    result_queue._recv_bytes = recv_bytes


def read_message(
    reader: Connection, writer_died: Callable[[], bool], poller: Any
) -> bytes | bytearray:
    """Read one message as ``Connection.recv_bytes`` does; raise ``queue.Empty`` (having
    dropped its bytes) when it stays incomplete and ``writer_died()``. ``poller`` is a
    ``select.poll`` object with ``reader`` registered."""
    (size,) = struct.unpack("!i", _read_exactly(reader, 4, writer_died, poller))
    if size == -1:
        (size,) = struct.unpack("!Q", _read_exactly(reader, 8, writer_died, poller))
    return _read_exactly(reader, size, writer_died, poller)


def _read_exactly(
    reader: Connection, size: int, writer_died: Callable[[], bool], poller: Any
) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    handle = reader.fileno()
    received = 0
    while received < size:
        if poller.poll(POLL_S * 1000):
            count = os.readv(handle, [view[received:]])
            if count == 0:
                raise EOFError if received == 0 else OSError("got end of file during message")
            received += count
        elif writer_died():
            raise queue.Empty  # see NOTE [ Torn results ]
        else:
            time.sleep(0)  # nothing yet from a live writer: keep waiting
    return buffer
