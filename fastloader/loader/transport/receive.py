"""In the main process: a batch rebuilt from its slot as tensors that point into it.

See NOTE [ Batch transport ] in ``__init__.py``. ``rebuild`` runs when a ``SlotBatch``
descriptor is unpickled (by the result queue's reader, or torch's pin-memory thread): it maps
the region (once per region), wraps it in one buffer object per batch whose finalizer frees
the row, and makes each array leaf a view of it. No byte of the batch is copied here.
A descriptor whose row was reclaimed after its worker died rebuilds into ``STALE``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import pickle
import threading
import weakref
from typing import Any

import numpy as np
import torch

from fastloader.datasets.collate import plain_values
from fastloader.loader.transport.groups import Batches
from fastloader.loader.transport.slots import COLUMNS, READY, SlotFile, numpy_dtype

_registry: dict[int, list[SlotFile]] = {}  # key -> the slot files of one worker pool
_keys = itertools.count(1)
_lock = threading.Lock()
#: held while a row is checked and taken (``rebuild``) or reclaimed (``reclaim_unsent``), so
#: a reclaimed row is never rebuilt (the pin-memory thread rebuilds while supervision heals)
rows_lock = threading.Lock()


class Stale:
    """What a descriptor of a reclaimed row rebuilds into: its task was sent again."""

    __slots__ = ()


STALE = Stale()


def register(files: list[SlotFile]) -> int:
    """Make a pool's slot files known to ``rebuild``; returns their key."""
    with _lock:
        key = next(_keys)
        _registry[key] = files
    return key


def slot_files(key: int) -> list[SlotFile]:
    """The slot files registered under ``key``."""
    return _registry[key]


def unregister(key: int) -> None:
    """Forget a pool's slot files (its workers are gone); batches already out stay valid."""
    with _lock:
        files = _registry.pop(key, [])
    for slots in files:
        slots.close()


def rebuild(
    key: int,
    worker: int,
    row: int,
    offset: int,
    capacity: int,
    generation: int,
    layout: bytes,
    skeleton: Any,
) -> Any:
    """The batch a worker wrote into ``row`` of its slot file, as views of the region.
    ``layout`` is the pickled tuple of ``(kind, dtype, shape, offset, nbytes)`` per leaf;
    ``STALE`` when the row no longer holds that batch (reclaimed after its worker died)."""
    files = _registry.get(key)
    if files is None:
        raise RuntimeError("fastloader: a batch from a DataLoader whose workers were shut down")
    slots = files[worker]
    entries = _layouts.get(layout)
    if entries is None:
        entries = _unpickled_layout(layout)
    words, at = slots.words, row * COLUMNS  # (state, offset, capacity, generation)
    with rows_lock:
        if words[at] != READY or words[at + 3] != generation:
            return STALE
        region = slots.region(row, offset, capacity)
        owner = (ctypes.c_ubyte * entries[0]).from_buffer(region)
        slots.live[row] = (ctypes.addressof(owner), entries[0])
    # NOTE [ Batch transport ]: slot lifetime. Only this process frees the row: a forked
    # child's copy of the batch dying says nothing about this process's.
    weakref.finalize(owner, _free, slots, row, os.getpid()).atexit = False
    arrays = [_view(owner, entry) for entry in entries[1]]
    if type(skeleton) is Batches:  # NOTE [ Batches per message ]: one region, several batches
        batches = Batches([_fill(item, arrays) for item in skeleton])
        batches.nbytes = entries[0]
        return batches
    return _fill(skeleton, arrays)


_layouts: dict[bytes, tuple[int, list]] = {}  # pickled layout -> bytes used, its entries
_LAYOUTS_KEPT = 256  # ragged batches make a new layout each: then none is kept


def _unpickled_layout(pickled: bytes) -> tuple[int, list]:
    # each entry: (kind, dtype, shape, offset, nbytes, the NumPy dtype a tensor is viewed
    # through, or None where NumPy has none: bfloat16, float8, ...)
    layout = pickle.loads(pickled)
    used = max(1, max((entry[3] + entry[4] for entry in layout), default=1))
    entries = [(*entry, numpy_dtype(entry[1]) if entry[0] == "t" else None) for entry in layout]
    if len(_layouts) >= _LAYOUTS_KEPT:
        _layouts.clear()
    _layouts[pickled] = (used, entries)
    return used, entries


def _free(slots: SlotFile, row: int, pid: int) -> None:
    # (takes no lock: a collection inside ``rebuild`` may run it while ``rows_lock`` is held)
    if os.getpid() == pid:
        slots.live.pop(row, None)
        if not slots.pinned or row not in slots.pinned:
            slots.free(row)


def reclaim_unsent(key: int, worker: int) -> int:
    """Free the rows of dead worker ``worker`` that are READY but hold no batch of this
    process: their descriptors were never sent, or are still in the pipe and will rebuild as
    ``STALE`` (their tasks are sent again). Returns how many were freed."""
    files = _registry.get(key)
    if files is None:
        return 0
    slots = files[worker]
    with rows_lock:
        states = slots.table[:, 0]
        unsent = [
            row
            for row in map(int, (states == READY).nonzero()[0])
            if row not in slots.live and row not in slots.pinned
        ]
        for row in unsent:
            slots.free(row)
    return len(unsent)


def _view(owner: Any, entry: tuple) -> Any:
    # every view keeps ``owner`` alive (an ndarray holds the object whose buffer it views)
    kind, dtype, shape, offset, nbytes, as_numpy = entry
    if kind == "n":
        return np.ndarray(shape, dtype, owner, offset)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if as_numpy is not None:  # a third of torch.frombuffer and a view
        return torch.from_numpy(np.ndarray(shape, as_numpy, owner, offset))
    count = nbytes // dtype.itemsize
    return torch.frombuffer(owner, dtype=dtype, count=count, offset=offset).view(shape)


class Leaf:
    """Where an array leaf of the batch sits in the skeleton: its index in the layout."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple:
        return (Leaf, (self.index,))


def _fill(value: Any, arrays: list[Any]) -> Any:
    kind = type(value)
    if kind is Leaf:
        return arrays[value.index]
    if kind is list or kind is tuple:
        if plain_values(value):
            return value  # strings, numbers: no leaf inside
        items = [_fill(item, arrays) for item in value]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {key: _fill(item, arrays) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return kind(*(_fill(item, arrays) for item in value))
    return value
