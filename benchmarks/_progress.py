"""What a suite run is doing, as it goes: one progress bar per comparison (stage), on stderr.

A comparison may say which step it is on with :func:`note` (shown after its bar, or as a line
when stderr is not a terminal); it needs nothing else. The bar of a stage with an expected
duration fills with elapsed time (a comparison's steps are not equal, so time is the honest
measure); a stage without one shows the elapsed time only.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

from tqdm import tqdm

_current: Stage | None = None


def note(text: str) -> None:
    """Say what the running comparison is doing now, e.g. ``note("throughput, round 2 of 3")``."""
    stage = _current
    if stage is not None:
        stage.note(text)


class Stage:
    """A progress bar for one stage of the run, ticking every half second in a thread.

    Args:
        label: what runs, e.g. ``"[1/6] loader"``.
        expected_s: how long it usually takes at this size on 2 cores; None if unknown.
        bar: draw a bar (stderr is a terminal); else print a line at the start, per note, and
            at the end.
    """

    def __init__(self, label: str, expected_s: float | None, bar: bool) -> None:
        self.label, self.expected_s, self.use_bar = label, expected_s, bar
        self._bar: tqdm | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def __enter__(self) -> Stage:
        global _current
        self._started = time.perf_counter()
        if self.use_bar:
            known = self.expected_s is not None
            bar_format = (
                "{desc}: {percentage:3.0f}%|{bar:24}| {elapsed} of ~{total:.0f} s{postfix}"
                if known
                else "{desc}: {elapsed}{postfix}"
            )
            self._bar = tqdm(
                total=self.expected_s if known else None,
                desc=self.label,
                bar_format=bar_format,
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        else:
            expected = f" (usually ~{self.expected_s:.0f} s)" if self.expected_s else ""
            print(f"{self.label} ...{expected}", file=sys.stderr, flush=True)
        _current = self
        return self

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)
        else:
            print(f"{self.label}: {text}", file=sys.stderr, flush=True)

    def finish(self, status: str) -> None:
        """End the stage with ``status`` (e.g. ``"done in 52 s"``)."""
        global _current
        _current = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.bar_format = "{desc}: " + status.replace("{", "{{").replace("}", "}}")
            self._bar.refresh()
            self._bar.close()
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
        assert self._bar is not None
        while not self._stop.wait(0.5):
            elapsed = time.perf_counter() - self._started
            if self.expected_s is not None:  # never claim 100% before the stage ends
                elapsed = min(elapsed, self.expected_s * 0.99)
            self._bar.n = elapsed
            self._bar.refresh()
