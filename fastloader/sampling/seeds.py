"""Seeds derived from (seed, epoch, index): the one source every order and sample starts from.

Pure functions of integers (SplitMix64 mixing), the same in every process and on every run:
``epoch_seed`` draws an epoch's shuffle order, ``sample_seed``/``batch_seeds`` the RNG seeds of
each sample (NOTE [ Seeding contract ] in loader/seeding.py).
"""

from __future__ import annotations

import operator
import zlib
from typing import Any

import numpy as np

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a cheap, well-distributed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _index_key(index: Any) -> int:
    try:
        return operator.index(index) & _MASK64
    except TypeError:
        # Non-integer keys (strings, tuples): a hash that is stable across processes,
        # unlike hash(), which is salted per interpreter.
        return zlib.crc32(repr(index).encode())


def _epoch_key(seed: int, epoch: int) -> int:
    return _mix64(_mix64(seed & _MASK64) ^ (epoch & _MASK64))


def sample_seed(seed: int, epoch: int, index: Any) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` for a loader seeded with ``seed``."""
    return _mix64(_epoch_key(seed, epoch) ^ _index_key(index))


def epoch_seed(seed: int, epoch: int) -> int:
    """The 63-bit seed from which the shuffle order of ``epoch`` is drawn."""
    return _mix64(_mix64(seed & _MASK64 ^ 0x5EED) ^ (epoch & _MASK64)) >> 1


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """``_mix64`` of every element of a uint64 array (NumPy wraps modulo 2**64 as ``_MASK64``)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _MUL1
    x = (x ^ (x >> _S27)) * _MUL2
    return x ^ (x >> _S31)


def _index_keys(indices: Any) -> np.ndarray | None:
    """``_index_key`` of each index as a uint64 array, or None when they are not all integers."""
    try:
        array = np.asarray(indices)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.ndim != 1 or array.dtype.kind not in "iub":
        return None  # strings, tuples, floats, ints beyond 64 bits: the per-index path
    if array.dtype.kind == "i":
        return array.astype(np.int64, copy=False).view(np.uint64)  # two's complement, as & MASK
    return array.astype(np.uint64)


def batch_seeds(seed: int, epoch: int, indices: Any) -> list[int]:
    """``[sample_seed(seed, epoch, i) for i in indices]``, vectorised for integer indices."""
    key = _epoch_key(seed, epoch)
    keys = _index_keys(indices)
    if keys is None:
        return [_mix64(key ^ _index_key(index)) for index in indices]
    return _mix64_array(keys ^ np.uint64(key)).tolist()
