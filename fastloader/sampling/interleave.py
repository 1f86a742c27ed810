"""Which source each position of one weight segment draws from: a pure function of the position.

Pure NumPy, no torch: the main process computes it for the samplers, tests call it alone.

NOTE [ The interleave ]

Within a segment of constant weights, position ``t`` (counted from the segment's start) is
assigned to a source by a binary tree whose leaves are the sources of positive weight and
whose inner nodes split a stream of positions in two. A node holding integer weight ``b``
with ``a`` of it in its left subtree sends its ``n``-th position (``n`` counted in its own
stream) left exactly when ``c(n + 1) > c(n)`` for

    c(n) = floor((n * a + floor(b / 2)) / b)        (the left child's draws before n)

the rounded line of slope ``a / b``: a Sturmian split. Its left child's ``m``-th position is
the node's position where ``c`` steps to ``m + 1``; its right child's is the rest. Hence:

- **Pure and cheap.** How many draws each source had before ``t`` is a walk from the root:
  ``c`` at each node, O(depth) per source, O(sources) in all; which source position ``t``
  goes to, and which of that source's draws it is, is one walk too. Nothing is replayed, so a
  resume at position 5e7 costs what one at 0 costs.
- **Exact proportions.** ``c(b) = a``: a node sends exactly ``a`` of every ``b`` positions
  left, and every window of ``m`` consecutive positions of a node's stream sends
  ``floor(m a / b)`` or ``ceil(m a / b)`` left (the balance of a Sturmian word).
- **Every window holds its share.** A source at depth ``d`` is off its share ``w N`` in a
  window of ``N`` positions by less than ``1 + r_1 + r_1 r_2 + ...``, where ``r_i`` is its
  subtree's share of the node ``i`` levels up. The tree is built as a Huffman code (join the
  two lightest subtrees first), which keeps heavy sources near the root. The bound is about 2
  (it passes 2 only for weights spanning orders of magnitude along one branch); observed:
  below 2 for 150 random weight vectors of 2 to 16 sources (at most 1.99, median 1.52).
  Measured on 16 sources with weights from 4 to 1 (geometric) over 200 000 windows of 1000
  positions: every count within ``floor(w N) - 1 .. ceil(w N) + 1``, 97.9 % of them exactly
  ``floor`` or ``ceil``, the largest deviation 1.62 samples (tests/test_mix_order.py).
  A bound of 1 for every source and every weight vector is impossible: with three or more
  sources of pairwise distinct shares, a sequence in which every window holds ``floor`` or
  ``ceil`` of each share exists only for the shares ``2**(k-1), ..., 2, 1`` over ``2**k - 1``
  (Fraenkel's conjecture, proved up to 7 sources).

Weights are integers here (``quantize``: parts in 2**20 of the total), so the arithmetic is
exact in uint64 up to ``MAX_POSITION`` positions per segment, and identical in every process.

NOTE [ Weights that overflow or vanish ]

Weights are given at any scale, so two cases need care when they become shares:

- **The sum overflows** (``{"a": 1e308, "b": 1e308, "c": 1.0}``: each weight finite, the sum
  ``inf``). The weights are first multiplied by a power of two that brings the largest below
  1. That is exact in binary floating point (only the exponents change), so every share is
  bit for bit what it would be with unbounded floats, and the proportions are the given ones:
  the mix accepts such weights. Weights whose sum is finite are not touched, so their order is
  unchanged. (A weight that is no finite float, such as ``10**400``, is refused by ``Mix``.)
- **A share below half the resolution** (a positive weight under ``2**-21`` of the total):
  rounding would give it no part, and ``quantize`` gives it the minimum, one part in 2**20,
  so the source would be drawn at over twice its rate (``1e-9`` of the total would be drawn
  at about ``1e-6``). ``Mix`` refuses such weights, naming them (``below_resolution``): give
  the source weight 0, or at least ``2**-21`` of the total. A share of one part or more is
  off by at most half a part, as every share is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MAX_POSITION",
    "RESOLUTION",
    "Interleave",
    "as_weight",
    "below_resolution",
    "quantize",
]

_SCALE = 1 << 20  # integer weights sum to about this
RESOLUTION = 1 / _SCALE  # the smallest share a source of positive weight gets
MAX_POSITION = 1 << 42  # positions per segment the uint64 arithmetic stays exact for


def _shares(weights: Sequence[float]) -> list[float]:
    """Each weight's share of the total, in parts of 2**20 (see NOTE [ Weights that overflow
    or vanish ])."""
    total = float(sum(weights))
    if total == math.inf:  # finite weights whose sum overflows: scale by a power of two first
        exponent = math.frexp(max(weights))[1]
        weights = [math.ldexp(w, -exponent) for w in weights]
        total = float(sum(weights))
    if not total > 0:
        raise ValueError("at least one weight must be positive")
    return [w / total * _SCALE for w in weights]


def as_weight(value: object) -> float | None:
    """A weight as a float: None unless an int or float (not a bool) that is finite, >= 0 and
    fits a float (``10**400`` does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        weight = float(value)
    except OverflowError:
        return None
    return weight if math.isfinite(weight) and weight >= 0 else None


def quantize(weights: Sequence[float]) -> list[int]:
    """Integer weights in parts of 2**20 of the total; a positive weight stays positive."""
    shares = _shares(weights)
    return [0 if w == 0 else max(1, round(x)) for w, x in zip(weights, shares, strict=True)]


def below_resolution(weights: Sequence[float]) -> list[tuple[int, float]]:
    """``(index, share of the total)`` of each positive weight too small for its share:
    ``quantize`` would raise it to the minimum share, ``RESOLUTION``, over twice its own."""
    shares = _shares(weights)
    return [
        (s, x / _SCALE)
        for s, (w, x) in enumerate(zip(weights, shares, strict=True))
        if w > 0 and round(x) == 0
    ]


class Interleave:
    """The interleave of one weight segment; see NOTE [ The interleave ].

    Args:
        weights: one non-negative integer weight per source (``quantize``); at least one
            positive. Sources of weight 0 are never drawn.
    """

    def __init__(self, weights: Sequence[int]) -> None:
        self.weights = [int(w) for w in weights]
        heap = [(w, s, ("leaf", s)) for s, w in enumerate(self.weights) if w > 0]
        if not heap:
            raise ValueError("at least one weight must be positive")
        heapq.heapify(heap)
        tie = len(self.weights)
        while len(heap) > 1:  # Huffman: join the two lightest, the heavier one on the left
            w_light, _, light = heapq.heappop(heap)
            w_heavy, _, heavy = heapq.heappop(heap)
            heapq.heappush(heap, (w_light + w_heavy, tie, ("node", heavy, light, w_heavy)))
            tie += 1
        self.total, _, self.root = heap[0]

    def counts(self, t: int) -> list[int]:
        """Draws of each source among positions ``[0, t)`` of the segment (O(sources))."""
        out = [0] * len(self.weights)
        stack = [(self.root, self.total, int(t))]
        while stack:
            node, b, n = stack.pop()
            if node[0] == "leaf":
                out[node[1]] = n
                continue
            _, left, right, a = node
            c = (n * a + b // 2) // b
            stack.append((left, a, c))
            stack.append((right, b - a, n - c))
        return out

    def assign(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For positions ``t`` of the segment: (source, that source's draw number in the
        segment), both int64 arrays of ``t``'s shape."""
        t = np.asarray(t, dtype=np.int64).ravel()
        if t.size and (t.min() < 0 or t.max() >= MAX_POSITION):
            raise ValueError(f"positions in a weight segment must lie in [0, {MAX_POSITION})")
        source = np.empty(t.size, dtype=np.int64)
        draw = np.empty(t.size, dtype=np.int64)
        stack = [(self.root, self.total, np.arange(t.size), t.astype(np.uint64))]
        while stack:
            node, b, where, n = stack.pop()
            if not where.size:
                continue
            if node[0] == "leaf":
                source[where] = node[1]
                draw[where] = n.astype(np.int64)
                continue
            _, left, right, a = node
            ua, ub, half = np.uint64(a), np.uint64(b), np.uint64(b // 2)
            before = (n * ua + half) // ub
            goes_left = (n + np.uint64(1)) * ua + half >= (before + np.uint64(1)) * ub
            stack.append((left, a, where[goes_left], before[goes_left]))
            rest = ~goes_left
            stack.append((right, b - a, where[rest], (n - before)[rest]))
        return source, draw
