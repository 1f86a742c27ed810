"""A permutation of ``range(n)`` computed one element at a time: no per-sample array.

Pure NumPy (no torch, nothing of fastloader's): the same numbers in every process.

NOTE [ Permutations on the fly ]

A mixed order needs, for source ``s`` in its ``q``-th shuffled epoch, the ``o``-th index of a
random permutation of ``range(n_s)``. ``torch.randperm`` would hold ``n_s`` indices per source
and epoch (8 bytes each: 800 MB for 10**8 samples); here the permutation is a bijection
computed from its key and the offset alone, so the order state is the key (8 bytes):

- A balanced Feistel network on ``2h`` bits (``h = ceil(bits(n - 1) / 2)``, so the domain
  ``2**(2h)`` is below ``4n``): the offset is split into halves ``(L, R)`` of ``h`` bits and
  ``_ROUNDS`` times ``(L, R) <- (R, L xor f(R, k_i))``, with ``f`` the SplitMix64 finaliser of
  ``R`` and the round key ``k_i``. Every round is invertible whatever ``f`` is, so the network
  is a bijection of ``[0, 2**(2h))``.
- Cycle walking maps it onto ``[0, n)``: a value ``>= n`` is put through the network again
  until it lands below ``n``. Following the cycle of a bijection from a point inside ``[0, n)``
  returns inside ``[0, n)``, so the result is a bijection of ``[0, n)``; fewer than 4 passes
  are needed on average (the domain is below ``4n``).

Four rounds of a 64-bit mixer are far from a cryptographic permutation but shuffle well for
training (tested: every element once, positions uniform, neighbours decorrelated); each key
gives another permutation, and ``permutation_key`` derives the key from the mix's seed, the
source's name, the pass and the source epoch, so a source reshuffles each time it is read
through again. Cost: about 20 NumPy operations per element and pass (vectorised over blocks).
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = [
    "domain_bits",
    "permutation_key",
    "permute",
    "permute_many",
    "round_keys",
    "splitmix64",
]

_MASK64 = (1 << 64) - 1
_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser of a Python int (taken modulo 2**64): a 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_array(x: np.ndarray) -> np.ndarray:
    """``splitmix64`` of every element of a uint64 array (NumPy wraps modulo 2**64 without a
    warning for arrays, unlike NumPy scalars: pass arrays)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _MUL1
    x = (x ^ (x >> _S27)) * _MUL2
    return x ^ (x >> _S31)


def name_key(name: str) -> int:
    """A stable 64-bit key of a source name (the same in every process and Python run)."""
    data = name.encode("utf-8")
    return splitmix64(zlib.crc32(data) | (zlib.adler32(data) << 32))


def permutation_key(seed: int, name: str, *parts: int) -> int:
    """The key of one permutation: from the mix's seed, a source's name and small ints."""
    key = splitmix64((seed & _MASK64) ^ name_key(name))
    for part in parts:
        key = splitmix64(key ^ (part & _MASK64))
    return key


def round_keys(key: int) -> list[int]:
    """The Feistel round keys of a permutation key."""
    keys, state = [], key
    for _ in range(_ROUNDS):
        state = splitmix64(state)
        keys.append(state)
    return keys


def _network(x: np.ndarray, bits: np.ndarray, keys: np.ndarray) -> np.ndarray:
    # hi (a = ceil(b/2) bits) ^= f(lo (c bits), k), then rotate the b bits left by a: lo and
    # hi trade places, so the next round changes the bits this one read
    high = (bits + np.uint64(1)) >> np.uint64(1)
    low = bits - high
    mask_low = (np.uint64(1) << low) - np.uint64(1)
    mask_high = (np.uint64(1) << high) - np.uint64(1)
    mask = (np.uint64(1) << bits) - np.uint64(1)
    for k in keys:
        x = x ^ ((mix_array((x & mask_low) ^ k) & mask_high) << low)
        x = ((x << high) & mask) | (x >> low)
    return x


def permute_many(
    offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray, bits: np.ndarray | None = None
) -> np.ndarray:
    """``permute`` of each offset with its own size and key, in one vectorised pass.

    Args:
        offsets: positions in the permutations, each in ``[0, size)``.
        sizes: the size of each offset's permutation (at least 1).
        keys: uint64 array of shape ``(_ROUNDS, len(offsets))``: each offset's round keys
            (``round_keys``).
        bits: ``domain_bits(size)`` of each offset, if the caller has them at hand.

    Returns:
        An int64 array: the permuted values.
    """
    x = np.asarray(offsets, dtype=np.uint64).copy()
    sizes = np.asarray(sizes, dtype=np.uint64)
    if bits is None:
        distinct, which = np.unique(sizes, return_inverse=True)
        table = np.asarray([domain_bits(int(n)) for n in distinct], dtype=np.uint64)
        bits = table[which.ravel()]
    x = _network(x, bits, keys)
    outside = np.flatnonzero(x >= sizes)
    while outside.size:  # cycle walking: back into [0, n) along the bijection's cycle
        walked = _network(x[outside], bits[outside], keys[:, outside])
        x[outside] = walked
        outside = outside[walked >= sizes[outside]]
    x[sizes <= 1] = 0
    return x.astype(np.int64)


def domain_bits(n: int) -> int:
    """Bits of the network's domain for ``range(n)``: ``2**bits`` is below ``2n``."""
    return max(1, (int(n) - 1).bit_length())


def permute(offsets: np.ndarray, n: int, key: int) -> np.ndarray:
    """The ``offsets``-th elements of the permutation of ``range(n)`` keyed by ``key``.

    See NOTE [ Permutations on the fly ]. Every offset must lie in ``[0, n)``.

    Args:
        offsets: positions in the permutation (an int array).
        n: the size of the permuted range (at least 1, below 2**62).
        key: a 64-bit key; another key gives another permutation.

    Returns:
        An int64 array of the same shape: the permuted values, each in ``[0, n)``.
    """
    x = np.asarray(offsets, dtype=np.uint64).ravel()
    keys = np.asarray(round_keys(key), dtype=np.uint64)[:, None].repeat(x.size, axis=1)
    out = permute_many(x, np.full(x.size, n, dtype=np.uint64), keys)
    return out.reshape(np.shape(offsets))
