"""Queue puts that write the pipe in the calling thread, without multiprocessing's feeder.

NOTE [ Puts without a feeder thread ]

``multiprocessing.Queue.put`` appends to a buffer and wakes the queue's feeder thread, which
pickles and writes. For the loader's messages (a task: an epoch and a batch of indices; a
result: a slot descriptor of a few hundred bytes, NOTE [ Batch transport ]) waking that thread
and handing the GIL back and forth costs more than the write: py-spy found 15 % of a busy
worker's time and 4 % of the main process's in ``Condition.notify`` of ``put`` (issue 30's
pose batches, 2 workers, 2-core box). ``write_directly(queue)`` gives one queue a ``put``
that pickles and writes in the calling thread:

* **Never blocking.** A write to a full pipe waits until the reader makes room; a dead
  reader (a killed worker, for a task queue) would leave the main loop waiting forever. A
  message is written here only when that cannot happen: it fits in one page with its length
  (``PAGESIZE``, 4 KB) and the pipe has a free page (``poll`` says ``POLLOUT``: Linux's pipe
  then either appends the write to its last page or puts it in a free one, whole, at once),
  and only while holding the queue's write lock, as the feeder holds it, so no other writer
  (another worker, on the shared result queue) can take that page in between. Counting free
  bytes is not enough: small writes that do not fit the last page's rest start a new page, so
  a pipe of 64 KB blocked a 200-byte write with 64,000 bytes unread.
* **Order.** A message that does not fit goes to the feeder thread, and from then on every
  message of that queue in this process does (the feeder's buffer may still hold it when
  the next one comes): per writer, messages keep their order.
* **Torn messages.** A write into a free page is completed by the kernel at once;
  a worker killed while writing its result is still counted by NOTE [ Torn results ]
  (``counted`` marks these writes as the feeder's are).
* **Reading tasks.** A worker's task queue has one reader, the worker. ``BufferedGet`` is its
  ``get``: one ``read`` takes every message already in the pipe (tasks are sent up to 8
  ahead: NOTE [ Prefetch depth by batch bytes ]) and later gets cut them from the buffer,
  where ``Queue.get`` made a poller, polled, took the queue's read lock and read twice per
  message (22 us of a worker's 210 us per pose batch). A worker that dies with tasks in its
  buffer loses nothing that was not lost before: its replacement gets a new queue and the
  tasks again (NOTE [ Supervised workers ]).
* **Pickling.** ``ForkingPickler.dumps`` copies copyreg's and multiprocessing's reducer
  tables into a new dict for every message (half of its 4 us for a task). ``dumps`` pickles
  with the same reducers, merged once and merged again when either table changes (a module
  registering a reducer later, as ``torch.multiprocessing`` does on import, or replacing one):
  comparing the tables with the copies costs well under a microsecond.
"""

from __future__ import annotations

import copyreg
import io
import mmap
import os
import pickle
import select
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.reduction import ForkingPickler
from queue import Empty, Full
from typing import Any

# (copyreg's table, multiprocessing's reducers, the two merged), replaced whole when either
# table changes: one assignment, so a thread never sees a merge of other tables
_reducers: tuple[dict, dict, dict] = ({}, {}, {})


def dumps(obj: Any) -> memoryview:
    """``ForkingPickler.dumps(obj)``, without merging the reducer tables per message."""
    global _reducers
    tables = _reducers
    if tables[0] != copyreg.dispatch_table or tables[1] != ForkingPickler._extra_reducers:
        copied, extra = dict(copyreg.dispatch_table), dict(ForkingPickler._extra_reducers)
        tables = _reducers = (copied, extra, {**copied, **extra})
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = tables[2]
    pickler.dump(obj)
    return buffer.getbuffer()


class DirectPut:
    """``queue.put`` written in the calling thread while it fits the pipe (see the NOTE)."""

    def __init__(self, queue: Any, counted: AbstractContextManager | None = None) -> None:
        self._queue = queue
        self._feeder_put = queue.put  # the queue's own put (the feeder thread)
        self._counted = counted if counted is not None else nullcontext()
        self._fed = False  # True once a message went to the feeder: order (see the NOTE)
        self._writable = select.poll()
        self._writable.register(queue._writer.fileno(), select.POLLOUT)

    def __call__(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        queue = self._queue
        if self._fed or queue._closed:
            return self._feeder_put(obj, block, timeout)
        message = dumps(obj)
        if len(message) + 4 > mmap.PAGESIZE:  # Connection.send_bytes: 4 bytes of length
            return self._to_feeder(message, block, timeout)
        if not queue._sem.acquire(block, timeout):  # as Queue.put: the count get() releases
            raise Full
        writer = queue._writer
        lock = queue._wlock
        if lock is not None:
            lock.acquire()
        try:
            if self._writable.poll(0):  # a free page: NOTE [ Puts without a feeder thread ]
                with self._counted:
                    writer.send_bytes(message)
                return None
        finally:
            if lock is not None:
                lock.release()
        queue._sem.release()  # taken again by the feeder's put
        return self._to_feeder(message, block, timeout)

    def _to_feeder(self, message: Any, block: bool, timeout: float | None) -> None:
        self._fed = True
        # already pickled (a tensor's pickle shares its memory once): sent as it is
        return self._feeder_put(_Pickled(bytes(message)), block, timeout)


class _Pickled:
    """A message pickled already: the reader's unpickling gives the original object."""

    __slots__ = ("message",)

    def __init__(self, message: bytes) -> None:
        self.message = message

    def __reduce__(self) -> tuple:
        return (pickle.loads, (self.message,))


class Framed:
    """Bytes read from a pipe, cut into multiprocessing's messages (``Connection.send_bytes``:
    a 4-byte big-endian length, or -1 and 8 more bytes of it, then the body).

    Small messages are read in chunks of whatever the pipe holds; the body of a message bigger
    than a chunk is read straight into a buffer of its size (``room``), as
    ``Connection.recv_bytes`` does, so a large result is not copied again here.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._start = 0  # where the next message's length begins
        self._body: bytearray | None = None  # a large message's body, being read into
        self._received = 0  # bytes of it read

    def room(self) -> memoryview | None:
        """Where the next read goes while a large message's body is read (its rest); None:
        read a chunk and ``feed`` it."""
        if self._body is None:
            return None
        return memoryview(self._body)[self._received :]

    def received(self, count: int) -> None:
        """``count`` bytes were read into ``room()``."""
        self._received += count

    def feed(self, chunk: bytes) -> None:
        """Append bytes read from the pipe."""
        self._buffer += chunk
        if self._bounds() is None:
            self._read_body_directly()

    def begun(self) -> bool:
        """Whether bytes of a message not yet taken are held (whole or not)."""
        return self._body is not None or len(self._buffer) > self._start

    def whole(self) -> bool:
        """Whether the next message is whole."""
        body = self._body  # (read once: another thread may take it meanwhile)
        if body is not None:
            return self._received == len(body)
        return self._bounds() is not None

    def take(self) -> bytes | bytearray | None:
        """The next message's body if it is whole, else None."""
        if self._body is not None:
            if self._received < len(self._body):
                return None
            body, self._body = self._body, None
            return body
        bounds = self._bounds()
        if bounds is None:
            return None
        body_at, stop = bounds
        buffer = self._buffer
        message = bytes(buffer[body_at:stop])
        if stop == len(buffer):
            buffer.clear()
            stop = 0
        elif stop > READ_BYTES:  # read past: drop it
            del buffer[:stop]
            stop = 0
        self._start = stop
        return message

    def drop_begun(self) -> None:
        """Forget a message begun (its writer died: NOTE [ Torn results ])."""
        self._body = None
        del self._buffer[self._start :]

    def _read_body_directly(self) -> None:
        # the next message is incomplete: if it is large, its body goes to a buffer of its own
        header = self._header()
        if header is None or header[1] <= READ_BYTES:
            return
        body_at, size = header
        held = self._buffer[body_at:]
        self._body = bytearray(size)
        self._body[: len(held)] = held
        self._received = len(held)
        del self._buffer[self._start :]  # nothing follows an incomplete message

    def _header(self) -> tuple[int, int] | None:
        # (where the next message's body begins, its size), once its length is whole
        buffer, start = self._buffer, self._start
        have = len(buffer) - start
        if have < 4:
            return None
        size = int.from_bytes(buffer[start : start + 4], "big", signed=True)
        if size != -1:
            return start + 4, size
        if have < 12:  # over 2 GB: 8 more bytes of length
            return None
        return start + 12, int.from_bytes(buffer[start + 4 : start + 12], "big")

    def _bounds(self) -> tuple[int, int] | None:
        header = self._header()
        if header is None:
            return None
        body_at, size = header
        return (body_at, body_at + size) if len(self._buffer) >= body_at + size else None


def read_into(fd: int, framed: Framed) -> bool:
    """One read from ``fd`` into ``framed``; False at end of file."""
    room = framed.room()
    if room is not None:
        count = os.readv(fd, [room])
        framed.received(count)
        return count > 0
    chunk = os.read(fd, READ_BYTES)
    framed.feed(chunk)
    return bool(chunk)


READ_BYTES = 1 << 16  # a pipe's default capacity: what one read takes at most


class BufferedGet:
    """``queue.get`` for the only reader of ``queue``: every message in the pipe in one read
    (see the NOTE, "Reading tasks"). Raises ``queue.Empty`` and ``EOFError`` as ``get`` does."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._fd = queue._reader.fileno()
        self._readable = select.poll()
        self._readable.register(self._fd, select.POLLIN)
        self._framed = Framed()

    def __call__(self, block: bool = True, timeout: float | None = None) -> Any:
        message = self._framed.take()
        if message is None:
            deadline = None if timeout is None or not block else time.monotonic() + timeout
            while message is None:  # (never blocks in read: a torn message times out too)
                if not block:
                    wait_ms: float | None = 0
                elif deadline is None:
                    wait_ms = None
                else:
                    wait_ms = max(0.0, deadline - time.monotonic()) * 1000
                if not self._readable.poll(wait_ms):
                    raise Empty
                if not read_into(self._fd, self._framed):
                    raise EOFError
                message = self._framed.take()
        self._queue._sem.release()  # as Queue.get: the count put() acquired
        return pickle.loads(message)


#: False leaves every queue to its feeder thread (benchmarks/transport.py measures both).
ENABLED = True


def reads_directly() -> bool:
    """Whether task queues are read through ``BufferedGet`` (see the NOTE, "Reading
    tasks"; on Linux, with ``ENABLED``)."""
    return ENABLED and sys.platform == "linux"


def write_directly(queue: Any, counted: AbstractContextManager | None = None) -> bool:
    """Give ``queue`` (a ``multiprocessing.Queue`` no message was put on yet in this process)
    a ``put`` that writes in the calling thread (NOTE [ Puts without a feeder thread ]).

    ``counted`` is entered around each write (NOTE [ Torn results ]). Returns whether
    the queue was changed (on Linux only: the NOTE relies on how its pipes fill).
    """
    if not ENABLED or sys.platform != "linux" or queue._buffer:
        return False
    queue.put = DirectPut(queue, counted)
    return True
