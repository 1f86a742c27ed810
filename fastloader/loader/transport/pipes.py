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
"""

from __future__ import annotations

import mmap
import pickle
import select
import sys
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.reduction import ForkingPickler
from queue import Full
from typing import Any


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
        message = ForkingPickler.dumps(obj)
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


#: False leaves every queue to its feeder thread (benchmarks/transport.py measures both).
ENABLED = True


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
