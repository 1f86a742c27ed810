"""What a suite run is doing, as it goes: one progress bar per comparison (stage), on stderr.

A comparison may say which step it is on with :func:`note`, and how much measured work is
left with :func:`plan` and :func:`advance` (rounds, epochs: any unit of roughly equal cost);
it needs nothing else. The time left is always estimated from what this run measured:

- within a stage that planned its work, from the rate of the work done so far (once a unit
  is done);
- otherwise, on an idle machine (load average below 1 at the start), from the stage's usual
  duration on 2 idle cores, scaled by how much slower than usual this run's earlier stages
  were (:class:`Pace`). A busy machine slows each stage by its own factor (measured at load
  7: the pipeline 6x its usual time, the loader comparison, which sleeps for its training
  steps, 3x), so there a stage that did not plan its work shows its elapsed time only: a
  guess off by 2x is worse than none. An estimate under a second is not shown ("~0 s left",
  repeated, would be wrong every time).

On a terminal the run's progress is one line: the running stage's bar, redrawn twice a second
and erased when the stage ends, so that the summary printed at the end is the first screen.
When stderr is not a terminal (a log), each stage prints a line when it starts, one every
``QUIET_LINE_S`` seconds while it runs (with its latest note and the estimate), and one when it
ends; notes alone print nothing.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from types import TracebackType

from tqdm import tqdm

_current: Stage | None = None
QUIET_LINE_S = 30.0  # at most this long without a line when stderr is not a terminal


def note(text: str) -> None:
    """Say what the running comparison is doing now, e.g. ``note("throughput, round 2 of 3")``."""
    stage = _current
    if stage is not None:
        stage.note(text)


def plan(total: float) -> None:
    """Say that ``total`` units of similar work are left in the running comparison (from now)."""
    stage = _current
    if stage is not None:
        stage.plan(total)


def advance(units: float = 1) -> None:
    """Say that ``units`` of the planned work are done."""
    stage = _current
    if stage is not None:
        stage.advance(units)


class Pace:
    """How much slower than its usual duration each finished stage ran (median), to scale the
    estimates of the stages still to come.

    Args:
        idle: whether the machine was idle at the start: on a busy one, no estimate comes from
            the usual durations (see the module docstring).
    """

    def __init__(self, idle: bool = True) -> None:
        self.factors: list[float] = []
        self.idle = idle

    def record(self, usual_s: float | None, took_s: float) -> None:
        if usual_s:
            self.factors.append(took_s / usual_s)

    def scale(self, usual_s: float | None) -> float | None:
        if usual_s is None or not self.idle:
            return None
        return usual_s * (statistics.median(self.factors) if self.factors else 1.0)


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.1f} min"


class Stage:
    """A progress bar (or progress lines) for one stage of the run.

    Args:
        label: what runs, e.g. ``"[1/6] loader"``.
        expected_s: how long it should take on this machine (already scaled); None if unknown.
        bar: draw a bar (stderr is a terminal); else print lines.
    """

    def __init__(self, label: str, expected_s: float | None, bar: bool) -> None:
        self.label, self.expected_s, self.use_bar = label, expected_s, bar
        self._bar: tqdm | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = self._planned_at = self._last_line = 0.0
        self._total = self._done = 0.0
        self._text = ""

    def __enter__(self) -> Stage:
        global _current
        self._started = self._last_line = time.perf_counter()
        if self.use_bar:
            self._bar = tqdm(
                total=100,
                desc=self.label,
                bar_format="{desc}: {percentage:3.0f}%|{bar:24}| {postfix}",
                file=sys.stderr,
                leave=False,  # erased at the end: one line of progress, then the summary
                dynamic_ncols=True,
            )
        else:
            expected = f" (~{_seconds(self.expected_s)})" if self.expected_s else ""
            print(f"{self.label} ...{expected}", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()
        _current = self
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def left_s(self) -> float | None:
        """Seconds left: from the planned work's measured rate, else from the expected time."""
        now = time.perf_counter()
        left = None
        if self._total and self._done:
            rate = self._done / (now - self._planned_at)
            left = max(self._total - self._done, 0.0) / rate
        elif self.expected_s is not None and not self._total:
            left = self.expected_s - self.elapsed()
        return left if left is not None and left >= 1 else None  # never "~0 s left"

    def plan(self, total: float) -> None:
        self._total, self._done, self._planned_at = float(total), 0.0, time.perf_counter()

    def advance(self, units: float) -> None:
        self._done += units

    def note(self, text: str) -> None:
        self._text = text
        if self._bar is not None:
            self._draw()

    def _status(self) -> str:
        left = self.left_s()
        estimate = "" if left is None else f", ~{_seconds(left)} left"
        text = f"{self._text}; " if self._text else ""
        return f"{text}{_seconds(self.elapsed())}{estimate}"

    def _line(self) -> None:
        self._last_line = time.perf_counter()
        print(f"{self.label}: {self._status()}", file=sys.stderr, flush=True)

    def _draw(self) -> None:
        assert self._bar is not None
        left, elapsed = self.left_s(), self.elapsed()
        fraction = elapsed / (elapsed + left) if left is not None else 0.0
        self._bar.n = min(99.0, 100 * fraction)  # never claim 100% before the stage ends
        self._bar.set_postfix_str(self._status(), refresh=True)

    def finish(self, status: str) -> None:
        """End the stage with ``status`` (e.g. ``"done in 52 s"``)."""
        global _current
        _current = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.close()  # the summary says what each stage gave
        else:
            print(f"{self.label}: {status}", file=sys.stderr, flush=True)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._stop.is_set():
            self.finish("interrupted" if kind is not None else "done")

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            if self._bar is not None:
                self._draw()
            elif time.perf_counter() - self._last_line >= QUIET_LINE_S:
                self._line()
