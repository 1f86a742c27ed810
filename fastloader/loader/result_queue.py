"""Worker results that a dead worker left half-written: found and dropped, never waited on.

NOTE [ Torn results ]

A worker sends each result through the pool's result queue, a pipe shared by all workers: a
4-byte length, then the pickled result (tensors travel through shared memory, anything else —
bytes, strings, NumPy arrays — through the pipe itself). A worker killed while writing (the
OOM killer, a segfault in another thread) leaves part of a message in the pipe, and Python's
``Connection.recv_bytes`` then waits forever for the rest: no death check or ``timeout=``
runs while the main process is blocked inside it.

Writers take the queue's write lock around each message, so at most one message is being
written at a time. Each worker counts in a shared array the messages its queue feeder thread is
writing (``mark_writes``, installed in every worker at start-up). A count, not a flag, and
only the feeder's sends: a worker's ``multiprocessing.resource_sharer`` thread sends small
messages of its own (answering for a tensor's file descriptor) while the feeder writes a large
result, and a flag it lowered on the way out hid the feeder's write (a worker killed then hung
the loop forever). The main process reads messages with a ``GuardedReader`` (``guard_reads``),
which never blocks for long: while a message is incomplete it waits in short polls, and when
no byte comes and a worker whose count is up is dead, the writer of this message is that
worker (no one else could write while it held the lock), so the partial message is dropped and
the read answers "nothing yet" (``queue.Empty``). The pipe is then at the start of the next
message. A message from a live writer that stays incomplete for ``PATIENCE_S`` is kept and the
read answers ``queue.Empty`` too, so ``timeout=`` and the death checks run; the next read goes
on with it. torch's own death check then finds the dead worker, and supervision replaces it
and re-sends its tasks (NOTE [ Supervised workers ] in loader/supervision.py); without
supervision, torch's "worker exited unexpectedly" error is raised. Before a replacement
starts, the pool asks the reader to drop a partial message of the dead writer
(``drop_torn``), then clears the dead worker's count, after its write lock was released
(``release_orphaned_write_lock``).
"""

from __future__ import annotations

import queue
import select
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from fastloader.loader.transport.pipes import Framed, read_into

POLL_S = 0.05  # how long a read waits for more bytes before checking for a dead writer
PATIENCE_S = 0.5  # how long one read waits on an incomplete message before answering Empty
_FEEDER = "QueueFeederThread"  # multiprocessing's name for the thread that writes a queue


def mark_writes(writing: Any, slot: int) -> WriteCount:
    """In a worker: count in ``writing[slot]`` the messages this process is writing to a
    queue's pipe (its result queue).

    Patches ``Connection._send_bytes`` (looked up on each send, also by the queue's feeder
    thread) in this worker process only. Only sends from a queue's feeder thread count: other
    threads' messages (``multiprocessing.resource_sharer`` answering for a tensor's file
    descriptor) go to other pipes, and a count, not a flag, so no sender can lower another's
    mark. See NOTE [ Torn results ].

    Returns:
        The count, to enter around a write made outside the feeder thread (NOTE [ Puts
        without a feeder thread ] in loader/transport/pipes.py).
    """
    original = Connection._send_bytes
    count = WriteCount(writing, slot)

    def send_bytes_marked(self: Connection, buf: Any) -> None:
        if threading.current_thread().name != _FEEDER:
            original(self, buf)
            return
        with count:
            original(self, buf)

    Connection._send_bytes = send_bytes_marked  # type: ignore[method-assign]
    return count


class WriteCount:
    """``writing[slot]`` raised while entered (by any thread: entries nest and overlap)."""

    __slots__ = ("_writing", "_slot", "_lock")

    def __init__(self, writing: Any, slot: int) -> None:
        self._writing = writing
        self._slot = slot
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._writing[self._slot] += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._writing[self._slot] -= 1


def guard_reads(result_queue: Any, writing: Any, workers: Sequence[Any]) -> GuardedReader:
    """In the main process: read ``result_queue``'s messages with a ``GuardedReader``.

    Args:
        result_queue: the pool's multiprocessing result queue.
        writing: the shared counts that ``mark_writes`` raises, one per worker slot.
        workers: the pool's list of worker processes (updated in place as they are replaced).

    Returns:
        The reader, whose ``drop_torn`` the pool calls before it replaces a dead worker.
    """

    def torn_writer_died() -> bool:
        for slot, count in enumerate(writing):
            if count > 0 and slot < len(workers) and not workers[slot].is_alive():
                return True
        return False

    reader = GuardedReader(result_queue._reader, torn_writer_died)
    result_queue._recv_bytes = reader
    result_queue._poll = reader.poll  # it sees messages already read into its buffer
    reader.lock = result_queue._rlock
    return reader


class GuardedReader:
    """Reads one message as ``Connection.recv_bytes`` does, but never blocks for long.

    A message still incomplete after ``PATIENCE_S`` is kept and the read answers
    ``queue.Empty`` (so the caller's death checks and ``timeout=`` run); the next call goes on
    with it. When its writer is dead (``writer_died()``) the partial message is dropped and the
    read answers ``queue.Empty``: the pipe is then at the start of the next message. See
    NOTE [ Torn results ].

    Each read takes every byte in the pipe (up to ``READ_BYTES``) and later calls cut the
    messages from that buffer, so results that arrived together cost one ``poll`` and one
    ``read``; ``poll`` stands in for the queue's own (it sees the buffer). A partial message
    is always the buffer's tail: a writer holds the queue's write lock from its message's
    first byte to its last.
    """

    def __init__(self, reader: Connection, writer_died: Callable[[], bool]) -> None:
        self._handle = reader.fileno()
        self._writer_died = writer_died
        self._poller = select.poll()  # made once: this runs for every result
        self._poller.register(self._handle, select.POLLIN | select.POLLHUP)
        self.lock: Any = None  # the queue's read lock, held around every read
        self._framed = Framed()

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message can be read (the queue's ``_poll``), waiting up to ``timeout``.

        A message begun counts as readable, as the pipe's own poll counted it before it was
        read: the read then waits for its rest at most ``PATIENCE_S``, and drops it if its
        writer died (never a long wait holding the read lock while a torn message sits in
        the buffer). ``Queue.empty()`` calls this without the lock: a thread reading
        meanwhile costs a wrong answer at worst, which the locked read corrects."""
        if self._framed.begun():
            return True
        try:
            return bool(self._poller.poll(None if timeout is None else max(0.0, timeout) * 1000))
        except RuntimeError:  # polled by another thread this moment ("concurrent poll()")
            return True

    def __call__(self) -> bytes:
        deadline = time.monotonic() + PATIENCE_S
        while True:
            message = self._framed.take()
            if message is not None:
                return message
            self._read(deadline)

    def _read(self, deadline: float) -> None:
        if self._poller.poll(POLL_S * 1000):
            begun = self._framed.begun()
            if not read_into(self._handle, self._framed):
                if begun:
                    raise OSError("got end of file during message")
                raise EOFError
        elif self._writer_died():
            self._framed.drop_begun()
            raise queue.Empty  # see NOTE [ Torn results ]
        elif time.monotonic() >= deadline:
            raise queue.Empty  # the partial message is kept for the next call
        else:
            time.sleep(0)  # nothing yet from a live writer: keep waiting

    def drop_torn(self) -> None:
        """Drop a partial message whose writer is dead; the pool calls this before it
        replaces a dead worker (which clears the dead worker's count)."""
        if self.lock is not None and not self.lock.acquire(timeout=2 * PATIENCE_S + 1):
            return  # a read in another thread (pin memory) holds it, and will drop it itself
        try:
            if self._framed.begun() and not self._framed.whole() and self._writer_died():
                self._framed.drop_begun()
        finally:
            if self.lock is not None:
                self.lock.release()
