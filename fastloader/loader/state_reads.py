"""Which RNGs had their state read (not drawn from) while a batch loaded: ``StateReads``.

Runs in the process that loads data. A fingerprint (``rngs.FINGERPRINTS``) sees draws, not
reads: NOTE [ Lazy seeding ] in loader/lazy_seeding.py says why reads count as draws.
"""

from __future__ import annotations

import operator
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastloader.loader.rngs import SEEDERS

#: Functions that read an RNG's state without drawing from it, by (module, name, RNG index in
#: SEEDERS order); ``torch.random.fork_rng`` reads through ``torch.get_rng_state``.
_STATE_READERS = (
    (random, "getstate", 0),
    (np.random, "get_state", 1),
    (np.random.mtrand, "get_state", 1),
    *(
        (module, "get_bit_generator", 1)  # its .state, or the generator drawn from directly
        for module in (np.random, np.random.mtrand)
        if hasattr(np.random, "get_bit_generator")  # numpy >= 1.25
    ),
    (torch, "initial_seed", 2),
    (torch.random, "initial_seed", 2),
    (torch, "get_rng_state", 2),
    (torch.random, "get_rng_state", 2),
)


_NONE_READ = [False] * len(SEEDERS)


class _ModuleReaders:
    """One module's functions of ``_STATE_READERS``: the originals and their wrappers."""

    __slots__ = ("namespace", "entries", "get", "current", "originals", "wrappers")

    def __init__(self, module: Any, entries: list[tuple[str, int]]) -> None:
        self.namespace = vars(module)
        self.entries = entries  # (name, RNG index)
        self.get = operator.itemgetter(*(name for name, _ in entries))
        self.current: Any = None  # what ``get`` gave when the wrappers were made
        self.originals: dict[str, Callable] = {}
        self.wrappers: dict[str, Callable] = {}

    def wrap_current(self) -> None:
        """Wrap the module's functions as they are now (patched by someone since: theirs)."""
        current = self.get(self.namespace)
        functions = current if len(self.entries) > 1 else (current,)  # itemgetter of one
        # one of our wrappers kept and put back by someone: what it wraps is the original
        functions = tuple(map(_original, functions))
        self.current = functions if len(self.entries) > 1 else functions[0]
        self.originals = {name: f for (name, _), f in zip(self.entries, functions, strict=True)}
        for replaced in self.wrappers.values():
            _ORIGINAL_OF.pop(replaced, None)  # the wrappers in use only (bounded)
        self.wrappers = {name: _recording(self.originals[name], rng) for name, rng in self.entries}


# NOTE [ One set of state-read wrappers ]
#
# Loaders loading in the main process can overlap: two threads (a validation loader beside
# the training one), or a dataset that iterates another loader inside ``__getitem__``. Each
# has its own ``StateReads``; the wrappers, like the module functions they replace, are the
# process's: installed when the first ``StateReads`` is entered, removed when the last one
# exits, and each read is recorded in every ``StateReads`` entered at that moment (a read
# another loader's sample made counts for this one too: the safe direction, a batch seeded
# that did not need it). Wrappers of one ``StateReads`` each, swapped in and out by each,
# left the outer loader's reads unrecorded after an inner one exited, or left a wrapper
# installed for good when two threads exited in the other order. A wrapper is known by
# identity (``_ORIGINAL_OF``), not by an attribute: a mock answers every attribute. A
# process forked while a batch loaded in another thread starts with no wrapper installed.
_entered: tuple[StateReads, ...] = ()  # replaced whole, under the lock: readers see one tuple
_entered_lock = threading.Lock()
_ORIGINAL_OF: dict[Callable, Callable] = {}  # each wrapper in use -> the function it wraps


def _original(function: Callable) -> Callable:
    """What ``function`` wraps if it is one of our wrappers, else ``function``."""
    try:
        return _ORIGINAL_OF.get(function, function)
    except TypeError:  # an unhashable callable of the user's: not ours
        return function


def _recording(original: Callable, rng: int) -> Callable:
    def reader(*args: Any, **kwargs: Any) -> Any:
        for reads in _entered:
            reads.read[rng] = True
        return original(*args, **kwargs)

    reader.__wrapped__ = original  # type: ignore[attr-defined]
    _ORIGINAL_OF[reader] = original
    return reader


def _module_readers() -> list[_ModuleReaders]:
    entries: dict[int, tuple[Any, list[tuple[str, int]]]] = {}
    for module, name, rng in _STATE_READERS:
        entries.setdefault(id(module), (module, []))[1].append((name, rng))
    return [_ModuleReaders(module, names) for module, names in entries.values()]


_MODULE_READERS = _module_readers()


def _install() -> None:
    for module in _MODULE_READERS:
        if module.get(module.namespace) != module.current:  # replaced since we wrapped
            module.wrap_current()
        module.namespace.update(module.wrappers)


def _uninstall() -> None:
    for module in _MODULE_READERS:
        module.namespace.update(module.originals)


def _forget_after_fork() -> None:
    # a child forked while another thread of the parent loaded a batch: that batch is not
    # this process's, and its wrappers must not stay installed here
    global _entered, _entered_lock
    _entered_lock = threading.Lock()
    if _entered:
        _entered = ()
        _uninstall()


os.register_at_fork(after_in_child=_forget_after_fork)


class StateReads:
    """While entered, records which RNGs had their state read through ``_STATE_READERS``.

    A fingerprint sees draws, not reads: NOTE [ Lazy seeding ] in loader/lazy_seeding.py. The
    module functions are swapped for recording wrappers only while a batch loads, and put back
    after: one ``dict.update`` of each module's namespace each way, the process's one set of
    wrappers (NOTE [ One set of state-read wrappers ]).
    """

    def __init__(self) -> None:
        self.read = [False] * len(SEEDERS)

    def __enter__(self) -> StateReads:
        global _entered
        self.read[:] = _NONE_READ
        with _entered_lock:
            entered = _entered
            if not entered:
                _install()
                _entered = (self,)
            else:
                _entered = (*entered, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _entered
        with _entered_lock:
            entered = _entered
            if len(entered) == 1 and entered[0] is self:  # the usual: the only one entered
                _entered = ()
                _uninstall()
            elif self in entered:  # not after a fork made while it was entered
                rest = list(entered)
                rest.remove(self)
                _entered = tuple(rest)
                if not rest:
                    _uninstall()
