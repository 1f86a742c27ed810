"""The three global RNGs a sample may draw from: seed each, tell whether one was drawn from,
save and restore their states cheaply.

Runs in the process that loads data (a worker, or the main process with ``num_workers=0``).
See NOTE [ Lazy seeding ] in loader/lazy_seeding.py for why fingerprints exist and what they detect.
"""

from __future__ import annotations

import _random
import ctypes
import random
import struct
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


# NOTE [ Fingerprints through views ]
#
# The fingerprints are taken twice a batch, so their cost is per batch, not per sample: with
# cheap samples in the main process (token windows, issue 30) a few microseconds are a few
# percent of the loader. Python's Mersenne Twister and NumPy's cached Gaussian sit at fixed
# addresses of objects that live as long as the process (``random._inst``,
# ``numpy.random.mtrand._rand``), NumPy's Mersenne Twister words in its bit generator's struct
# (fixed for that generator's life; the view is made again when the generator is replaced, and
# holds it). Each is read with ``bytes(view)`` over a memoryview made once: one C copy, where
# ``ctypes.string_at`` is a Python function around a foreign call. torch's state is
# ``get_state()``'s bytes, read through ``data_ptr()`` rather than a NumPy array made for it.
def _view(address: int, size: int) -> memoryview:
    """``size`` bytes at ``address`` as a memoryview (the caller keeps their owner alive)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


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
    # see NOTE [ Python's random state without getstate ], NOTE [ Fingerprints through views ]
    return bytes(_PY_MT_VIEW)


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
_PY_MT_VIEW = _view(id(_python_rng) + _PY_MT_OFFSET, _PY_MT_BYTES) if _PYTHON_RAW else None


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


# NOTE [ NumPy's cached Gaussian without get_state ]
#
# NumPy's legacy global RNG (``np.random.mtrand._rand``, a ``RandomState``) keeps a Gaussian
# cached outside its bit generator: ``has_gauss`` and ``gauss`` in its ``aug_bitgen_t``. A
# sample that draws one Gaussian while one is cached changes only those two fields, not the
# Mersenne Twister's words, and ``get_state()`` (the one public way to read them) builds a
# dict of arrays: 30-50 us. The struct ``{int has_gauss; double gauss}`` sits at a fixed
# offset of the ``RandomState`` object: it is found at import by drawing a Gaussian from a
# probe ``RandomState`` and looking for its bytes, then checked against ``get_state()``
# before and after more draws. If anything does not match (another NumPy, another layout),
# ``_NUMPY_AUG`` is None and ``get_state``/``set_state`` are used: correct, slower, and the
# loader's unseeded batches (NOTE [ Lazy seeding ]) are not taken.
_AUG_BYTES = 16  # int has_gauss; 4 bytes of padding; double gauss


def _aug_raw(state: Any, offset: int) -> tuple[int, float]:
    raw = ctypes.string_at(id(state) + offset, _AUG_BYTES)
    return int.from_bytes(raw[:4], sys.byteorder, signed=True), struct.unpack("d", raw[8:])[0]


def _find_numpy_aug() -> int | None:
    # see NOTE [ NumPy's cached Gaussian without get_state ]
    try:
        probe = np.random.RandomState(2024)
        probe.standard_normal()
        gauss = probe.get_state()[4]
        head = ctypes.string_at(id(probe), type(probe).__basicsize__)
        found = head.find(struct.pack("d", gauss))
        offset = found - 8
        if found < 8 or head.find(struct.pack("d", gauss), found + 1) != -1:
            return None
        for seed in (7, 8):
            other = np.random.RandomState(seed)
            for _ in range(3):
                state = other.get_state()
                if state[3] and _aug_raw(other, offset) != (state[3], state[4]):
                    return None
                if not state[3] and _aug_raw(other, offset)[0] != 0:
                    return None
                other.standard_normal()
        legacy = np.random.mtrand._rand
        known = type(legacy) is np.random.RandomState and _get_bit_generator is not None
        return offset if known else None
    except Exception:  # noqa: BLE001 - any surprise means: do not touch the memory
        return None


_NUMPY_AUG = _find_numpy_aug()
_numpy_legacy = np.random.mtrand._rand
_NUMPY_AUG_VIEW = None if _NUMPY_AUG is None else _view(id(_numpy_legacy) + _NUMPY_AUG, _AUG_BYTES)
#: (the bit generator, a view of its Mersenne Twister words): NOTE [ Fingerprints through views ]
_numpy_words_view: tuple[Any, memoryview | None] = (None, None)


def _numpy_words(generator: Any) -> bytes:
    global _numpy_words_view
    known, view = _numpy_words_view
    if generator is not known:  # the first call, or a generator installed since
        view = _view(generator.ctypes.state_address, _MT19937_STATE_BYTES)
        _numpy_words_view = (generator, view)
    return bytes(view)


def _numpy_raw() -> tuple | None:
    """The legacy global RNG's whole state as raw bytes (Mersenne Twister words and the
    cached Gaussian), with its bit generator; None where that cannot be read so."""
    generator = _numpy_bit_generator()
    if _NUMPY_AUG_VIEW is None or type(generator) is not np.random.MT19937:
        return None
    return generator, _numpy_words(generator), bytes(_NUMPY_AUG_VIEW)


def fingerprints_see_everything() -> bool:
    """Whether ``FINGERPRINTS`` see every draw from an RNG in any state, not only after it
    was seeded (NumPy's cached Gaussian is read: NOTE [ NumPy's cached Gaussian without
    get_state ])."""
    return _NUMPY_AUG is not None and type(_numpy_bit_generator()) is np.random.MT19937


def _numpy_fingerprint() -> Any:
    raw = _numpy_raw()
    if raw is not None:
        return raw
    generator = _numpy_bit_generator()
    if type(generator) is np.random.MT19937:
        # The raw state struct, read through numpy's public ctypes interface: a copy of 2.5 kB
        # instead of the dict of arrays ``get_state()`` builds (30-50 us). (Without the
        # cached Gaussian: a fingerprint taken after ``numpy.random.seed``, which clears it.)
        address = generator.ctypes.state_address
        return id(generator), ctypes.string_at(address, _MT19937_STATE_BYTES)
    return id(generator), repr(generator.state)  # a user-installed bit generator: slow, exact


def _torch_fingerprint() -> Any:
    state = _torch_rng.get_state()  # a new uint8 tensor: NOTE [ Fingerprints through views ]
    return ctypes.string_at(state.data_ptr(), state.numel())


#: One per RNG, in ``SEEDERS`` order: a value that differs after any draw from that RNG.
FINGERPRINTS: tuple[Callable[[], Any], ...] = (
    _python_fingerprint,
    _numpy_fingerprint,
    _torch_fingerprint,
)


def all_fingerprints() -> list:
    """``[fingerprint() for fingerprint in FINGERPRINTS]``: every RNG's, in one call."""
    return [_python_fingerprint(), _numpy_fingerprint(), _torch_fingerprint()]


class StateKeeper:
    """Saves and restores the full states of the three RNGs, cheaply where it can.

    Python's and NumPy's states are copied as raw bytes (NOTE [ Python's random state without
    getstate ], NOTE [ NumPy's cached Gaussian without get_state ]): a few microseconds, where
    ``getstate()``/``get_state()`` build tuples and dicts of arrays (10-50 us). Where NumPy's
    cannot be read so (a user-installed bit generator, an unknown layout), its state is saved
    with ``numpy.random.get_state()``.
    """

    def save(self) -> tuple:
        """The current states (for ``restore``)."""
        numpy_state = _numpy_raw()
        if numpy_state is None:
            numpy_state = np.random.get_state(legacy=False)  # a dict
        return _python_save(), numpy_state, _torch_rng.get_state()

    def restore(self, states: tuple) -> None:
        """Put back the states of ``save``."""
        python_state, numpy_state, torch_state = states
        _python_restore(python_state)
        _torch_rng.set_state(torch_state)
        if type(numpy_state) is tuple:  # from _numpy_raw
            generator, words, aug = numpy_state
            if _numpy_bit_generator() is not generator:  # replaced while the batch loaded
                np.random.set_bit_generator(generator)  # numpy >= 1.25, as _NUMPY_AUG needs
            ctypes.memmove(generator.ctypes.state_address, words, _MT19937_STATE_BYTES)
            ctypes.memmove(id(_numpy_legacy) + _NUMPY_AUG, aug, _AUG_BYTES)
            return
        np.random.set_state(numpy_state)


def states_from_fingerprints(fingerprints: list) -> tuple:
    """``FINGERPRINTS`` taken while ``fingerprints_see_everything()``, as ``StateKeeper``
    states: they hold each RNG's whole state."""
    python_state, numpy_state, torch_bytes = fingerprints
    return python_state, numpy_state, torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8)


class TrainingStates:
    """The training loop's RNG states while a batch loads in the main process: saved the
    first time the batch is about to change them (``save_once``), put back when the batch is
    loaded (``restore``). A batch that seeds nothing costs nothing."""

    __slots__ = ("_keeper", "_saved")

    def __init__(self) -> None:
        self._keeper = StateKeeper()
        self._saved: tuple | None = None

    def save_once(self, states: tuple | None = None) -> None:
        """Save the current states (or ``states``, taken earlier) unless saved already."""
        if self._saved is None:
            self._saved = states if states is not None else self._keeper.save()

    def restore(self) -> None:
        """Put back what ``save_once`` saved, if anything."""
        saved, self._saved = self._saved, None
        if saved is not None:
            self._keeper.restore(saved)


class NoStates:
    """``TrainingStates`` where there is no training loop to protect (a worker process)."""

    __slots__ = ()

    def save_once(self, states: tuple | None = None) -> None:
        pass

    def restore(self) -> None:
        pass


def get_states() -> tuple:
    """The full states of the three RNGs (for ``set_states``)."""
    return _python_rng.getstate(), np.random.get_state(), _torch_rng.get_state()


def set_states(states: tuple) -> None:
    """Restore states from ``get_states``."""
    _python_rng.setstate(states[0])
    np.random.set_state(states[1])
    _torch_rng.set_state(states[2])
