"""The three global RNGs a sample may draw from: seed each, tell whether one was drawn from,
save and restore their states cheaply.

Runs in the process that loads data (a worker, or the main process with ``num_workers=0``).
See NOTE [ Lazy seeding ] in loader/lazy_seeding.py for why fingerprints exist and what they detect.
"""

from __future__ import annotations

import _random
import ctypes
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_MASK63 = (1 << 63) - 1

# random.seed(int) is Random.seed (Python) around the C seeding; calling the C part directly
# and resetting gauss_next as the wrapper does saves a tenth of the per-sample cost.
_python_rng = random._inst
_seed_python_c = _random.Random.seed
_torch_rng = torch.default_generator
_seed_numpy_legacy = np.random.seed
_seed_torch = _torch_rng.manual_seed

#: Bytes of numpy's ``mt19937_state`` struct: ``uint32_t key[624]; int pos``.
_MT19937_STATE_BYTES = 624 * 4 + 4


def seed_python(seed: int) -> None:
    """``random.seed(seed)`` for the global ``random`` (cached Gaussian dropped too)."""
    _seed_python_c(_python_rng, seed)
    _python_rng.gauss_next = None


def seed_numpy(seed: int) -> None:
    """``numpy.random.seed`` with the low 32 bits (its legacy seeding takes no more)."""
    _seed_numpy_legacy(seed & 0xFFFFFFFF)


def seed_torch(seed: int) -> None:
    """torch's default CPU generator, with the low 63 bits (so ``initial_seed()`` fits int64)."""
    _seed_torch(seed & _MASK63)


#: The global RNGs in a fixed order: python's ``random``, numpy's legacy global, torch's CPU.
SEEDERS: tuple[Callable[[int], None], ...] = (seed_python, seed_numpy, seed_torch)
#: seeder -> (the call it makes, the mask it applies): the same seeding, one call less a sample.
DIRECT_SEEDERS: dict[Callable[[int], None], tuple[Callable[[int], Any], int]] = {
    seed_numpy: (_seed_numpy_legacy, 0xFFFFFFFF),
    seed_torch: (_seed_torch, _MASK63),
}
NAMES = ("random", "numpy.random", "torch")


def seed_rngs(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (global) and torch's default CPU generator.

    torch gets the low 63 bits, so ``torch.initial_seed()`` fits in an int64 as torch's own
    worker seeds do (a dataset may return it, and collating it must not overflow).
    """
    seed_python(seed)
    _seed_numpy_legacy(seed & 0xFFFFFFFF)
    _seed_torch(seed & _MASK63)


# numpy >= 1.25; taken now, as StateReads swaps the module's function while samples load
_get_bit_generator = getattr(np.random, "get_bit_generator", None)


def _numpy_bit_generator() -> Any:
    if _get_bit_generator is not None:
        return _get_bit_generator()
    return np.random.mtrand._rand._bit_generator


# NOTE [ Python's random state without getstate ]
#
# ``random.getstate()`` builds a tuple of 625 ints: 8-14 us, paid several times a batch by
# fingerprints and the main process's state swap. CPython keeps the Mersenne Twister of a
# ``random.Random`` right after the object header (``int index; uint32_t state[624]``), so the
# 2,500 bytes are read and written in place instead. The layout is not public: it is checked
# against ``getstate()`` at import, before and after a draw, and if it does not match (another
# interpreter, a changed struct) ``getstate``/``setstate`` are used.
_PY_MT_BYTES = 4 + 624 * 4
_PY_MT_OFFSET = object.__basicsize__  # the object header; the struct follows it


def _python_raw() -> bytes:
    # see NOTE [ Python's random state without getstate ]
    return ctypes.string_at(id(_python_rng) + _PY_MT_OFFSET, _PY_MT_BYTES)


def _python_layout_matches() -> bool:
    probe = random.Random(12345)
    try:
        for _ in range(2):
            raw = ctypes.string_at(id(probe) + _PY_MT_OFFSET, _PY_MT_BYTES)
            index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
            words = np.frombuffer(raw, dtype=np.uint32, offset=4).tolist()
            internal = probe.getstate()[1]
            if tuple(words) + (index,) != internal:
                return False
            probe.random()
        return True
    except Exception:  # noqa: BLE001 - any surprise means: do not touch the memory
        return False


_PYTHON_RAW = (
    _random.Random.__basicsize__ >= _PY_MT_OFFSET + _PY_MT_BYTES and _python_layout_matches()
)


def _python_fingerprint() -> Any:
    if _PYTHON_RAW:
        return _python_raw(), _python_rng.gauss_next
    return _python_rng.getstate()  # includes gauss_next


def _python_save() -> Any:
    if _PYTHON_RAW:
        return _python_raw(), _python_rng.gauss_next
    return _python_rng.getstate()


def _python_restore(state: Any) -> None:
    if _PYTHON_RAW:
        ctypes.memmove(id(_python_rng) + _PY_MT_OFFSET, state[0], _PY_MT_BYTES)
        _python_rng.gauss_next = state[1]
    else:
        _python_rng.setstate(state)


def _numpy_fingerprint() -> Any:
    generator = _numpy_bit_generator()
    if type(generator) is np.random.MT19937:
        # The raw state struct, read through numpy's public ctypes interface: a copy of 2.5 kB
        # instead of the dict of arrays ``get_state()`` builds (30-50 us).
        address = generator.ctypes.state_address
        return id(generator), ctypes.string_at(address, _MT19937_STATE_BYTES)
    return id(generator), repr(generator.state)  # a user-installed bit generator: slow, exact


def _torch_fingerprint() -> Any:
    return _torch_rng.get_state().numpy().tobytes()


#: One per RNG, in ``SEEDERS`` order: a value that differs after any draw from that RNG.
FINGERPRINTS: tuple[Callable[[], Any], ...] = (
    _python_fingerprint,
    _numpy_fingerprint,
    _torch_fingerprint,
)


#: Functions that read an RNG's state without drawing from it, by (module, name, RNG index in
#: SEEDERS order); ``torch.random.fork_rng`` reads through ``torch.get_rng_state``.
_STATE_READERS = (
    (random, "getstate", 0),
    (np.random, "get_state", 1),
    (np.random.mtrand, "get_state", 1),
    *(
        (module, "get_bit_generator", 1)  # its .state, or the generator drawn from directly
        for module in (np.random, np.random.mtrand)
        if _get_bit_generator is not None
    ),
    (torch, "initial_seed", 2),
    (torch.random, "initial_seed", 2),
    (torch, "get_rng_state", 2),
    (torch.random, "get_rng_state", 2),
)


class StateReads:
    """While entered, records which RNGs had their state read through ``_STATE_READERS``.

    A fingerprint sees draws, not reads: NOTE [ Lazy seeding ] in loader/lazy_seeding.py. The module
    functions are swapped for recording wrappers only while a batch loads, and put back after.
    """

    def __init__(self) -> None:
        self.read = [False] * len(SEEDERS)
        self._originals = [getattr(module, name) for module, name, _ in _STATE_READERS]
        self._wrappers = [
            self._recording(original, rng)
            for original, (_, _, rng) in zip(self._originals, _STATE_READERS, strict=True)
        ]

    def _recording(self, original: Callable, rng: int) -> Callable:
        read = self.read

        def reader(*args: Any, **kwargs: Any) -> Any:
            read[rng] = True
            return original(*args, **kwargs)

        reader.__wrapped__ = original  # type: ignore[attr-defined]
        return reader

    def __enter__(self) -> StateReads:
        read, originals, wrappers = self.read, self._originals, self._wrappers
        for index in range(len(read)):
            read[index] = False
        for index, (module, name, rng) in enumerate(_STATE_READERS):
            current = getattr(module, name)
            if current is not originals[index]:  # patched by someone since: wrap theirs
                originals[index] = current
                wrappers[index] = self._recording(current, rng)
            setattr(module, name, wrappers[index])
        return self

    def __exit__(self, *exc_info: object) -> None:
        for (module, name, _), original in zip(_STATE_READERS, self._originals, strict=True):
            setattr(module, name, original)


class StateKeeper:
    """Saves and restores the full states of the three RNGs, numpy's cheaply when it can.

    ``numpy.random.get_state()``/``set_state()`` cost 30-50 us each (a dict of arrays). When the
    state to save is the one this keeper restored last (same raw bytes) and that state held no
    cached Gaussian, the saved copy is reused; restoring such a state is ``numpy.random.seed``
    (which clears the cached Gaussian, as the state had none) and a copy of the raw bytes
    back. Training code cannot change the cached Gaussian without drawing (changing the raw
    bytes) when none was cached, so reusing the copy is exact.
    """

    def __init__(self) -> None:
        self._numpy_known: tuple | None = None  # (fingerprint, full state) last restored

    def save(self) -> tuple:
        """The current states (for ``restore``)."""
        fingerprint = _numpy_fingerprint()
        known = self._numpy_known
        if known is not None and known[0] == fingerprint:
            numpy_state = known
        else:
            numpy_state = (fingerprint, np.random.get_state())
        return _python_save(), numpy_state, _torch_rng.get_state()

    def restore(self, states: tuple) -> None:
        """Put back the states of ``save``."""
        python_state, (fingerprint, numpy_state), torch_state = states
        _python_restore(python_state)
        _torch_rng.set_state(torch_state)
        generator = _numpy_bit_generator()
        fast = (
            isinstance(numpy_state, tuple)
            and numpy_state[3] == 0  # no cached Gaussian
            and type(generator) is np.random.MT19937
            and id(generator) == fingerprint[0]
        )
        if fast:
            np.random.seed(0)  # clears the cached Gaussian
            ctypes.memmove(generator.ctypes.state_address, fingerprint[1], _MT19937_STATE_BYTES)
            self._numpy_known = (fingerprint, numpy_state)
        else:
            np.random.set_state(numpy_state)
            self._numpy_known = None


def get_states() -> tuple:
    """The full states of the three RNGs (for ``set_states``)."""
    return _python_rng.getstate(), np.random.get_state(), _torch_rng.get_state()


def set_states(states: tuple) -> None:
    """Restore states from ``get_states``."""
    _python_rng.setstate(states[0])
    np.random.set_state(states[1])
    _torch_rng.set_state(states[2])
