"""Download ahead: the threads of a rank's main process that fetch the shards its order reads
next into the shard cache (NOTE [ The shard cache ] in cache.py), before the readers ask.

``DownloadAhead`` is the part of ``ShardCache`` that does it: ``plan`` gives it the shards
this rank reads, in order; ``reading_at`` how far the order has been handed out; the threads
call the cache's ``ensure`` (one download per shard per node, as any reader's).

NOTE [ How far ahead ]
``ahead`` threads fetch the plan's shards in the order they are read, ``ahead`` at once, at
most ``ahead`` beyond the ones being read (the chunk of 256 positions the sampler hands out,
shard_order.py); a worker fetches a shard itself only when no one holds its lock. Measured
(benchmarks/remote.py ``link_rows``: 6 000 samples in 19 shards of 4 MB through a proxy
waiting 50 ms to the first byte, 100 MB/s per connection; 2 workers; load 3-8): ahead 2 read
a cold epoch 1.07-2.0x as fast as ahead 0 or 1; ahead 4 0.87-1.15x ahead 2; 4 ranges per
shard 0.95-1.19x 1 range. So ``ahead=2`` (the default): more costs CPU and cache room
(``cache_minimum`` counts ``ahead`` per rank); the CPU, not the link, bounded. Beyond that
depth a spare download goes on while there is room (NOTE [ Spare room ]). More threads only
while the readers wait for shards not fetched yet (an epoch's start, when the first batches
read every lane's first window) gained nothing: 4 or 8 more, median ratios 0.94-1.04x those of
none (6 000 and 20 000 samples, SeaweedFS on loopback, load 2.3-3.8): the CPU bounds them.

NOTE [ Spare room ]
Beyond ``ahead`` (1 or more: ``ahead=0`` fetches only the shards being read), one thread at a
time goes on down the plan while the cache has room to spare: room for the shard with
``minimum`` (``cache_minimum``) still free. A spare download never evicts; with no room the
shard is put back until the readers move on (``reading_at``). Shards fetched ahead and not
read yet are evicted last (``ShardCache._reserve``). Why: the lanes change windows at about
the same positions, so the order asks for up to lanes x window new shards at once; fetched
``ahead`` at a time, readers waited at every change while between changes the threads stood
idle (20 000 samples in 63 shards of 4 MB, SeaweedFS on loopback: cold epochs 1.5-2.2 s with
spare downloads, 2.9-4.8 s without, interleaved, load 1.7-2.2). One spare download at a time
is enough: 2 or 4 at once, median ratios 0.88-1.0x (20 000 samples, load 2.6-3.3).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["DownloadAhead"]


class DownloadAhead:
    """The download-ahead threads of a ``ShardCache`` (which gives ``shards`` and ``ensure``)."""

    shards: list[Any]

    def ensure(self, shard: Any, *, reader: bool = True, spare: bool = False) -> Any: ...

    def _ahead_state(self) -> None:
        """This process's own (a forked child or an unpickled copy has no plan, no thread)."""
        self._plan: tuple[np.ndarray, np.ndarray] | None = None
        self._position = 0
        self._ahead = self._next = 0  # how far ahead; the next shard of the plan to fetch
        self._plans = 0  # plans made: a spare download of an older plan leaves _next alone
        self._spare: int | None = None  # the position at which a spare download found no room
        self._threads: list[threading.Thread] = []
        self._wake = threading.Condition()  # guards the fields above
        self._stopped = False
        self.plan_error: BaseException | None = None

    def plan(self, shards: np.ndarray, ahead: int) -> None:
        """This rank reads ``shards[k]`` at its k-th read: download ahead of it."""
        order, first = _first_uses(shards)
        with self._wake:
            self._plan, self._ahead, self._position, self._next = (order, first), ahead, 0, 0
            self._stopped, self._spare = False, None
            self._plans += 1
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            while len(self._threads) < max(1, ahead):
                thread = threading.Thread(target=self._ahead_loop, daemon=True, name="shards")
                thread.start()
                self._threads.append(thread)
            self._wake.notify_all()

    def reading_at(self, position: int) -> None:
        """The order has been handed out up to ``position``: fetch ahead of it."""
        with self._wake:
            self._position = position
            if self._spare not in (None, -1, position):
                self._spare = None  # readers moved on: room may have been freed
            self._wake.notify_all()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()

    def _reading(self) -> int:
        """Holding ``_wake``: how many shards of the plan the order handed out reads."""
        assert self._plan is not None
        return int(np.searchsorted(self._plan[1], self._position, side="right"))

    def _claim(self) -> tuple[int, int, bool] | None:
        """Holding ``_wake``: the next shard of the plan to fetch (its place in the plan, the
        plan's number, whether it is a spare download), if it may be fetched now."""
        if self._plan is None or self._next >= len(self._plan[0]):
            return None
        reading = self._reading()
        spare = self._next >= reading + self._ahead
        if spare:
            if self._spare is not None or not self._ahead:  # one at a time; ahead=0: none
                return None
            self._spare = -1
        self._next += 1
        return self._next - 1, self._plans, spare

    def _unread(self) -> set[str]:
        """Shards this process fetched ahead that its order has not read yet."""
        with self._wake:
            if self._plan is None:
                return set()
            numbers = self._plan[0][self._reading() : self._next]
            return {self.shards[n].name for n in numbers}

    def _ahead_loop(self) -> None:
        while True:
            with self._wake:
                claim = None
                while not self._stopped and (claim := self._claim()) is None:
                    self._wake.wait(0.5)
                if self._stopped:
                    return
                at, plans, spare = claim
                shard = self.shards[int(self._plan[0][at])]  # type: ignore[index]
            try:
                got = self.ensure(shard, reader=False, spare=spare)
                if got is None and not self._put_back(at, plans):
                    self.ensure(shard, reader=False)  # within ``ahead`` by now
            except Exception as error:  # noqa: BLE001 - the reader meets it and raises
                self.plan_error = error
                return
            finally:
                if spare:
                    with self._wake:
                        self._spare = None if self._spare == -1 else self._spare

    def _put_back(self, at: int, plans: int) -> bool:
        """A spare download found no room: the plan's next again, and no spare download until
        the readers move on (NOTE [ Spare room ]). False if another thread went past it."""
        with self._wake:
            if plans != self._plans or self._next != at + 1:
                return plans != self._plans  # a new plan: this one is dropped
            self._next, self._spare = at, self._position
            return True


def _first_uses(shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shards in order of first use, and the read number of each first use."""
    unique, first = np.unique(np.asarray(shards), return_index=True)
    by_time = np.argsort(first)
    return unique[by_time], first[by_time]
