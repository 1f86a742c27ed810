"""Ratios of interleaved rounds: the comparisons' shared arithmetic."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median of the per-round ratios ``ours[i] / theirs[i]``.

    Rounds take turns, so a slow spell of a shared machine slows both sides of one round: the
    per-round ratio cancels it, where a ratio of two medians mixes rounds of different speeds.
    """
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def significant(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant digits, for reports: a ratio far below 1
    keeps its size (0.000412, where rounding to 3 decimals would print 0.0)."""
    return float(f"{value:.{digits}g}")


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """The order in which interleaved round ``round_`` runs ``names``: rotated by one each
    round, so no loader always runs first (after another's cache or page-cache warm-up)."""
    shift = round_ % len(names)
    return [*names[shift:], *names[:shift]]
