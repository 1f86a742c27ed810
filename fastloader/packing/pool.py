"""The packer's worker pool: items encoded in worker processes and handed back in order, each
image under a time limit, and an image that kills its worker skipped instead of ending the run.

The main-process side (:func:`encode_in_workers`) runs in the packer; ``_serve`` runs in each
worker process. See NOTE [ Per-image limits when packing ].
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any

from fastloader.packing.process import frozen_heap, signals_held, start_pool_worker
from fastloader.packing.worker import Encoded, encode_one

#: The longest one image may take to decode and encode in a packer worker, by default.
IMAGE_SECONDS = 120.0
_CHUNK = 16  # items per message to a worker: IPC stays cheap, memory in flight stays small
# An item whose worker dies this many times is skipped (listed, like an unreadable image).
# Fewer tries than the loader's POISON_DEATHS (loader/supervision.py), on purpose: here a death
# is blamed on one item (workers take one image at a time when retrying), and skipping costs
# one image of a pack that lists it; the loader blames a whole task (a batch of samples) and
# its verdict ends training, so it gives a death under memory pressure one more chance.
_DEATHS = 2
_IDLE = -1  # a worker's current item while it is between items (and before its first)

# NOTE [ Per-image limits when packing ]
# One hostile image must cost one skip line, never the run (nor the machine):
# * pixels: the header is read first (fastloader/vision/image_limits.py) and an image over PIL's
#   limit (Image.MAX_IMAGE_PIXELS, doubled as PIL does for its DecompressionBombError) is
#   skipped before any decoder allocates, in every process, with any number of workers;
# * time: each worker writes the index of the item it starts into a shared integer, and
#   `_IDLE` once the item is encoded, so the main process knows which item each worker is on
#   and since when (results may wait in the worker while the main process writes, so they
#   cannot tell; that wait is not the item's time). An item running past the
#   time limit (a progressive JPEG of 20 000 scans decodes for minutes in libjpeg, inside C
#   code that no Python signal handler interrupts) gets its worker SIGKILLed: the item is
#   skipped with the reason, a fresh worker takes the worker's other items;
# * a worker that dies (the OOM killer, a crash in a decoder) is replaced the same way and its
#   item tried once more in a fresh worker, then skipped, naming the signal: a
#   ProcessPoolExecutor would instead break for good (BrokenProcessPool) on the first death.
# With workers=0 items are encoded in the packer's own process: the pixel limit holds, the
# time limit cannot (nothing can stop libjpeg there); any workers >= 1 are processes.
# Results are yielded in item order; each worker has at most two chunks queued (no idle gap
# between chunks) and at most `4 * workers` chunks are ahead of the writer, so memory stays
# bounded however slow the writer is. A retried item goes alone to an idle worker.


def _serve(connection: Any, encoder: Callable[[Any], Encoded], parent: int, current: Any) -> None:
    """A worker process: encode the chunks received, sending back each result when done.

    A thread sends the results, so the next image is decoded while the main process is busy
    writing and the pipe is full (at most two chunks wait in this process).
    """
    start_pool_worker(encoder, parent)
    outbox: queue.Queue = queue.Queue(maxsize=2 * _CHUNK)
    sender = threading.Thread(target=_send_all, args=(connection, outbox), daemon=True)
    sender.start()
    try:
        while True:
            try:
                chunk = connection.recv()
            except (EOFError, OSError):
                return
            if chunk is None:
                return
            start, items = chunk
            for offset, item in enumerate(items):
                current.value = start + offset  # read by the main process, lock-free
                try:
                    message = ("done", start + offset, encode_one(item))
                except BaseException as error:  # a sample of the wrong kind: the run fails
                    message = ("error", start + offset, _sendable(error))
                current.value = _IDLE  # waiting to send is not the image's time
                outbox.put(message)
    finally:
        outbox.put(None)
        sender.join()


def _send_all(connection: Any, outbox: queue.Queue) -> None:
    while (message := outbox.get()) is not None:
        try:
            connection.send(message)
        except OSError:  # the main process stopped listening
            return


def _sendable(error: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class _Worker:
    def __init__(self, context: Any, encoder: Callable, parent: int) -> None:
        self.connection, child = context.Pipe()
        self.current = context.RawValue("q", _IDLE)  # the item the worker is encoding
        self.seen = -1
        self.process = context.Process(
            target=_serve, args=(child, encoder, parent, self.current), name="fastloader-pack"
        )  # not daemonic: a dataset may start processes (the finally of the pool stops them)
        self.process.start()
        child.close()
        self.pending: deque[int] = deque()  # indices sent and not done, in order
        self.since = 0.0  # when the item at pending[0] started

    def send(self, indices: list[int], items: Sequence) -> None:
        # consecutive indices go as one chunk; a retried item goes alone
        self.connection.send((indices[0], [items[index] for index in indices]))
        if not self.pending:  # else the item at work keeps its start time
            self.since = time.monotonic()
        self.pending.extend(indices)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.join()
        self.connection.close()


def _death(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


def _skip(item: Any, reason: str) -> Encoded:
    label = item[1] if isinstance(item, tuple) and len(item) == 2 else 0
    return Encoded(None, label, reason)


def encode_in_workers(
    encoder: Callable[[Any], Encoded],
    items: Sequence,
    workers: int,
    start_method: str,
    seconds: float = IMAGE_SECONDS,
) -> Iterator[Encoded]:
    """Yield the encoding of every item, in order, from ``workers`` processes.

    Args:
        encoder: called on each item in the workers (reaches each worker once).
        items: what to encode.
        workers: how many processes (at least 1).
        start_method: the multiprocessing start method.
        seconds: the time limit per item (see NOTE [ Per-image limits when packing ]).

    Raises:
        Exception: what the encoder raised for an item (a sample of the wrong kind), at once.
    """
    pool = _Pool(encoder, items, workers, start_method, seconds)
    try:
        with frozen_heap():  # see NOTE [ Forking the packer's workers ]
            pool.start()
        while pool.next_out < len(items):
            pool.feed()
            pool.collect()
            pool.supervise()
            yield from pool.in_order()
    finally:
        pool.stop()


class _Pool:
    """The main-process side of the packer's workers: feeding, collecting, supervising."""

    def __init__(
        self, encoder: Callable, items: Sequence, workers: int, start_method: str, seconds: float
    ) -> None:
        self.context = multiprocessing.get_context(start_method)
        self.encoder, self.items, self.seconds = encoder, items, seconds
        self.workers = workers
        self.size = max(1, min(_CHUNK, len(items) // (workers * 4)))
        self.parent = os.getpid()
        self.pool: list[_Worker] = []
        self.results: dict[int, Encoded] = {}
        self.retry: deque[int] = deque()
        self.deaths: dict[int, int] = {}
        self.next_in = self.next_out = 0

    def _new_worker(self) -> _Worker:
        return _Worker(self.context, self.encoder, self.parent)

    def start(self) -> None:
        for _ in range(self.workers):
            # held: a signal lands once the worker is in the pool that stop() ends
            # (NOTE [ Signals while packing ])
            with signals_held():
                self.pool.append(self._new_worker())

    def feed(self) -> None:
        """At most two chunks per worker (no idle gap between them); retried items alone."""
        size, items = self.size, self.items
        ahead = self.next_out + 4 * self.workers * size  # bounds the memory in flight
        for worker in self.pool:
            if len(worker.pending) > size or (self.retry and worker.pending):
                continue
            if self.retry:
                worker.send([self.retry.popleft()], items)
            elif self.next_in < min(len(items), ahead):
                stop = min(self.next_in + size, len(items))
                worker.send(list(range(self.next_in, stop)), items)
                self.next_in = stop

    def collect(self) -> None:
        """Wait (up to a second) for results or deaths; take the results that came."""
        busy = [worker for worker in self.pool if worker.pending]
        waits = [w.connection for w in busy] + [w.process.sentinel for w in busy]
        for ready in wait(waits, timeout=min(1.0, self.seconds)) if waits else ():
            worker = next(w for w in busy if ready in (w.connection, w.process.sentinel))
            if ready is worker.connection:
                _receive(worker, self.results)

    def _late(self, worker: _Worker) -> bool:
        if not worker.pending or worker.current.value == _IDLE:
            return False  # its results wait for the writer, or for the pipe
        return time.monotonic() - worker.since > self.seconds

    def supervise(self) -> None:
        """Replace workers that died or overran the time limit (NOTE [ Per-image limits when
        packing ])."""
        for slot, worker in enumerate(self.pool):
            alive = worker.process.is_alive()
            if worker.current.value != worker.seen:  # it started another item
                worker.seen, worker.since = worker.current.value, time.monotonic()
            if alive and not self._late(worker):
                continue
            while _receive(worker, self.results):
                pass  # results sent before it died
            if alive and not self._late(worker):
                continue
            self._replace(slot, worker, alive)

    def _replace(self, slot: int, worker: _Worker, alive: bool) -> None:
        late = self._late(worker)
        worker.kill()
        if worker.pending:
            index = _culprit(worker)
            if late and alive:
                reason = f"took more than {self.seconds:g} s to decode (a scan bomb?); stopped"
                self.results[index] = _skip(self.items[index], reason)
            else:
                self._blame(index, worker)
            self.retry.extend(worker.pending)
            worker.pending.clear()
        with signals_held():
            self.pool[slot] = self._new_worker()

    def _blame(self, index: int, worker: _Worker) -> None:
        self.deaths[index] = self.deaths.get(index, 0) + 1
        if self.deaths[index] >= _DEATHS:
            reason = f"its worker process died decoding it, {_DEATHS} times: "
            self.results[index] = _skip(self.items[index], reason + _death(worker.process))
        else:
            self.retry.appendleft(index)

    def in_order(self) -> Iterator[Encoded]:
        """The results that are next in order."""
        while self.next_out in self.results:
            yield self.results.pop(self.next_out)
            self.next_out += 1

    def stop(self) -> None:
        for worker in self.pool:
            with contextlib.suppress(OSError, ValueError):
                worker.connection.send(None)
        for worker in self.pool:
            worker.process.join(timeout=0 if worker.pending else 5)
            if worker.process.is_alive():
                worker.kill()
            else:
                worker.connection.close()


def _culprit(worker: _Worker) -> int:
    """The item ``worker`` was encoding when it was stopped or died, taken out of its pending
    items (its results still in the worker are lost: the others are sent again)."""
    index = worker.current.value
    if index not in worker.pending:  # died before it started one
        index = worker.pending[0]
    worker.pending.remove(index)
    return index


def _receive(worker: _Worker, results: dict[int, Encoded]) -> bool:
    """Take one message from ``worker`` if there is one; False when there is none."""
    try:
        if not worker.connection.poll():
            return False
        kind, index, value = worker.connection.recv()
    except (EOFError, OSError):
        return False
    if kind == "error":
        raise value
    results[index] = value
    if index in worker.pending:
        worker.pending.remove(index)
    return True
