"""The order of a mix of named sources: a pure function of (seed, position). No torch.

Runs wherever it is asked: the samplers call it in the main process, tests call it alone.

NOTE [ The mixed order as a pure function ]

A mix has sources ``name -> size`` (kept sorted by name, so the order of a dict does not
matter), a seed, a policy and a weight history: segments ``(start, weights)`` sorted by start,
the first at 0. Position ``P`` of the mixed stream maps to a sample in three steps, none of
which looks at any other position:

1. **Which source, and which of its draws.** The segment holding ``P`` (a bisection over the
   starts) gives ``t = P - start``; the segment's interleave (NOTE [ The interleave ] in
   interleave.py) gives the source ``s`` and its draw number ``j`` within the segment. The
   draws of every source before each segment (``bases``) are summed once when the history
   changes, in O(segments x sources), so source ``s``'s draw number is ``k = base + j``.
2. **Which index.** ``q, o = divmod(k, size)``: the ``o``-th element of the ``q``-th shuffled
   epoch of the source, a permutation computed on the fly (NOTE [ Permutations on the fly ] in
   permutation.py) keyed by (seed, name, pass, q). With ``shuffle=False`` it is ``o``; with
   ``policy="replacement"`` it is a hash of (seed, name, pass, k) modulo the size.
3. **Which code.** The loader hands the dataset one int per sample; the sampler passes
   ``code = q * total + offset[s] + index`` (``offset`` as in a ConcatDataset), which the
   ``Mix`` decodes in the worker without knowing any weights. The code also feeds the sample's
   seed (NOTE [ Seeding contract ]), so a small source read twice in an epoch is augmented
   differently each time.

Policies (what an epoch of the loader is):

- ``"cycle"`` (default): one endless stream; every source runs through shuffled epochs of its
  own, reshuffled each time (a small source repeats, a large one is read in part). Epoch ``e``
  of the loader is positions ``[e * L, (e + 1) * L)``, ``L = samples_per_epoch`` (default:
  the sources' total size). Weights may change (``Mix.set_weights``, a schedule).
- ``"replacement"``: as ``"cycle"``, each draw an independent uniform index of its source.
- ``"first_exhausted"`` / ``"all_exhausted"``: each loader epoch is one pass that ends right
  after the first (last) source's last sample; in ``"all_exhausted"`` sources that run out
  meanwhile start a fresh shuffled epoch. Each pass starts every source afresh (pass = the
  loader's epoch, in the keys). ``L`` follows from the weights, so they cannot change.
- ``"once"``: each loader epoch reads every sample of every source exactly once, source after
  source (in name order), shuffled within a source if ``shuffle``: for evaluation. Weights
  are not used.

``P`` is a position of the stream: ``e * L + i`` for the endless policies (epoch ``e``,
``i``-th sample), ``i`` within pass ``e`` for the others; ``global_position(e, i)`` returns the
loader's ``e * L + i`` in both cases, and the samplers pass that.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastloader.sampling.interleave import Interleave, quantize
from fastloader.sampling.permutation import (
    domain_bits,
    mix_array,
    permutation_key,
    permute_many,
    round_keys,
)

__all__ = ["ENDLESS", "INTERLEAVES", "POLICIES", "MixOrder"]

POLICIES = ("cycle", "replacement", "first_exhausted", "all_exhausted", "once")
ENDLESS = ("cycle", "replacement")  # policies whose weights may change
INTERLEAVES = ("smooth", "iid")


class MixOrder:
    """The mixed order; see NOTE [ The mixed order as a pure function ].

    Args:
        sizes: source name -> number of samples (at least 1 each).
        history: ``[(start, {name: weight})]``: the weights from each start position on,
            the first start 0. A name missing from a segment has weight 0 there.
        seed: the seed of every source's permutations (and of ``"iid"`` draws).
        policy: one of ``POLICIES``.
        interleave: ``"smooth"`` (NOTE [ The interleave ]) or ``"iid"`` (each position draws
            its source at random by weight; only with ``policy="replacement"``, as the draw
            number of a source at a position is not known without counting).
        shuffle: shuffle each source's epochs (else read each in index order).
        samples_per_epoch: ``L`` for the endless policies (default: the total size).
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        history: Sequence[tuple[int, Mapping[str, float]]],
        seed: int,
        policy: str = "cycle",
        interleave: str = "smooth",
        shuffle: bool = True,
        samples_per_epoch: int | None = None,
    ) -> None:
        self.names = sorted(sizes)
        self.sizes = [int(sizes[name]) for name in self.names]
        self.index = {name: s for s, name in enumerate(self.names)}
        self.offsets = np.cumsum([0, *self.sizes]).astype(np.int64)
        self.total = int(self.offsets[-1])
        self._bits = np.asarray([domain_bits(max(1, n)) for n in self.sizes], dtype=np.uint64)
        self.seed = int(seed)
        self.policy = policy
        self.interleave = interleave
        self.shuffle = bool(shuffle)
        self.samples_per_epoch = samples_per_epoch
        self._compile(history)
        self.epoch_length = self._epoch_length()

    # -- the weight history ---------------------------------------------------------------

    def _compile(self, history: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        self.history = [(int(start), dict(weights)) for start, weights in history]
        self.starts = [start for start, _ in self.history]
        self.segments: list[Interleave] = []
        self.bases: list[list[int]] = []
        base = [0] * len(self.names)
        for j, (start, weights) in enumerate(self.history):
            segment = Interleave(quantize([weights.get(name, 0.0) for name in self.names]))
            if j:
                previous = self.segments[-1].counts(start - self.starts[j - 1])
                base = [b + c for b, c in zip(base, previous, strict=True)]
            self.segments.append(segment)
            self.bases.append(base)

    def _epoch_length(self) -> int:
        if self.policy == "once":
            return self.total
        if self.policy in ENDLESS:
            return self.total if self.samples_per_epoch is None else int(self.samples_per_epoch)
        segment = self.segments[0]
        ends = [
            self._position_of_draw(s, self.sizes[s] - 1)
            for s in range(len(self.names))
            if segment.weights[s] > 0
        ]
        return (min(ends) if self.policy == "first_exhausted" else max(ends)) + 1

    def _position_of_draw(self, s: int, k: int) -> int:
        """The position (first segment) of source ``s``'s draw ``k``: a bisection on counts."""
        segment = self.segments[0]
        low, high = k, (k + 3) * segment.total // segment.weights[s] + 2
        while low < high:  # smallest t with counts(t + 1)[s] > k
            mid = (low + high) // 2
            if segment.counts(mid + 1)[s] > k:
                high = mid
            else:
                low = mid + 1
        return low

    # -- positions --------------------------------------------------------------------------

    def split(self, position: int) -> tuple[int, int]:
        """(pass, position in the stream) of a global position ``e * L + i``."""
        if self.policy in ENDLESS:
            return 0, int(position)
        return divmod(int(position), self.epoch_length)

    def draws_before(self, stream_position: int) -> list[int]:
        """Draws of each source (in name order) before a stream position: O(segments +
        sources) (a bisection, then one walk of the segment's tree)."""
        if self.policy == "once":
            p = int(stream_position)
            return [int(np.clip(p - self.offsets[s], 0, n)) for s, n in enumerate(self.sizes)]
        j = bisect.bisect_right(self.starts, stream_position) - 1
        counts = self.segments[j].counts(stream_position - self.starts[j])
        return [b + c for b, c in zip(self.bases[j], counts, strict=True)]

    def realised(self, start: int, end: int) -> dict[str, int]:
        """Samples of each source at global positions ``[start, end)`` of one loader epoch."""
        if end <= start:
            return dict.fromkeys(self.names, 0)
        pass_, first = self.split(start)
        before, after = self.draws_before(first), self.draws_before(first + end - start)
        return {name: after[s] - before[s] for s, name in enumerate(self.names)}

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For global positions: (pass, source, draw number of that source), int64 arrays."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.policy in ENDLESS:
            passes, stream = np.zeros_like(positions), positions
        else:
            passes, stream = np.divmod(positions, self.epoch_length)
        if self.policy == "once":
            source = np.searchsorted(self.offsets, stream, side="right") - 1
            return passes, source, stream - self.offsets[source]
        if self.interleave == "iid":
            return (passes, *self._iid(stream))
        source = np.empty_like(stream)
        draw = np.empty_like(stream)
        segment_of = np.searchsorted(np.asarray(self.starts), stream, side="right") - 1
        for j in np.unique(segment_of):
            where = np.flatnonzero(segment_of == j)
            s, k = self.segments[j].assign(stream[where] - self.starts[j])
            source[where] = s
            draw[where] = k + np.asarray(self.bases[j], dtype=np.int64)[s]
        return passes, source, draw

    def _iid(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # each position draws its source by weight from a hash of (seed, position); the draw
        # number is the position itself (unique; only "replacement" uses it, as a hash input)
        segment_of = np.searchsorted(np.asarray(self.starts), stream, side="right") - 1
        source = np.empty_like(stream)
        salt = np.uint64(permutation_key(self.seed, "iid"))
        u = mix_array(stream.astype(np.uint64) ^ salt) >> np.uint64(11)  # 53 bits
        for j in np.unique(segment_of):
            where = np.flatnonzero(segment_of == j)
            weights = np.asarray(self.segments[j].weights, dtype=np.float64)
            edges = np.cumsum(weights) / weights.sum() * float(1 << 53)
            source[where] = np.searchsorted(edges, u[where].astype(np.float64), side="right")
        return np.minimum(source, len(self.names) - 1), stream.copy()

    def indices(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For global positions: (source, sample index in it, code for the ``Mix``)."""
        passes, source, draw = self.locate(positions)
        sizes = np.asarray(self.sizes, dtype=np.int64)[source]
        epoch_of_source, offset = np.divmod(draw, sizes)
        index = offset.copy()
        if self.policy == "replacement":
            index = self._hashed(passes, source, draw, sizes)
        elif self.shuffle:
            index = self._permuted(passes, source, epoch_of_source, offset, sizes)
        code = epoch_of_source * self.total + self.offsets[source] + index
        return source, index, code

    def _permuted(self, passes, source, epoch, offset, sizes) -> np.ndarray:
        # one key per (pass, source, source epoch) present; a block holds a few of them, so a
        # dense table of the (small) range of group numbers replaces a sort
        low_p, low_q = int(passes.min()), int(epoch.min())
        span_q = int(epoch.max()) - low_q + 1
        count = len(self.names)
        combined = ((passes - low_p) * count + source) * span_q + (epoch - low_q)
        present = np.zeros(int(combined.max()) + 1, dtype=np.int64)
        present[combined] = 1
        groups = np.flatnonzero(present)
        present[groups] = np.arange(len(groups))
        table = []
        for group in groups.tolist():
            rest, q = divmod(group, span_q)
            p, s = divmod(rest, count)
            key = permutation_key(self.seed, self.names[s], p + low_p, q + low_q)
            table.append(round_keys(key))
        keys = np.asarray(table, dtype=np.uint64)
        return permute_many(offset, sizes, keys[present[combined]].T, self._bits[source])

    def _hashed(self, passes, source, draw, sizes) -> np.ndarray:
        keys = np.asarray([permutation_key(self.seed, name) for name in self.names], np.uint64)
        salted = mix_array(passes.astype(np.uint64)) ^ draw.astype(np.uint64)
        mixed = mix_array(keys[source] ^ mix_array(salted))
        return (mixed % sizes.astype(np.uint64)).astype(np.int64)

    def decode(self, code: int) -> tuple[int, int]:
        """(source number, sample index) of a code made by ``indices``."""
        rest = int(code) % self.total
        s = int(np.searchsorted(self.offsets, rest, side="right")) - 1
        return s, rest - int(self.offsets[s])

    def weights_at(self, stream_position: int) -> dict[str, float]:
        """The weights in force at a stream position (as given, not normalised)."""
        j = bisect.bisect_right(self.starts, stream_position) - 1
        return dict(self.history[j][1])

    def describe(self) -> dict[str, Any]:
        """The fields that decide the order, for messages and tests."""
        return {
            "seed": self.seed,
            "policy": self.policy,
            "interleave": self.interleave,
            "shuffle": self.shuffle,
            "samples_per_epoch": self.epoch_length,
            "sources": dict(zip(self.names, self.sizes, strict=True)),
            "weights": self.history,
        }
