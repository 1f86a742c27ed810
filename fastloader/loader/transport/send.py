"""In the worker: a batch written into a shared-memory slot, sent as a small descriptor.

See NOTE [ Batch transport ] in ``__init__.py``. ``SlotCollate`` wraps the loader's collate
function in every worker: it collates, writes every array leaf (tensors, NumPy arrays) into a
free region of this worker's slot file, marks the region READY (the commit) and returns a
``SlotBatch``, whose pickle is the region's row and the layout; everything that is not an
array (strings, numbers in lists, user objects) stays in a small skeleton pickled as usual.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import get_worker_info

from fastloader.datasets.collate import plain_values, stack_arrays
from fastloader.loader.transport import receive
from fastloader.loader.transport.groups import (
    GROUP_BYTES,
    Batches,
    LoadedGroup,
    Parts,
    batch_error,
)
from fastloader.loader.transport.receive import Leaf
from fastloader.loader.transport.slots import (
    FREE,
    READY,
    SlotFile,
    acquire,
    numpy_dtype,
    reclaim_torn,
    reduce_fd,
    restore_fd,
    torch_dtype,
)

ALIGN = 64  # bytes: every leaf starts on a cache line (and on any dtype's alignment)


class Stack:
    """Samples to be stacked into one tensor, straight into the slot (made by the collate
    hook in the iterators for the loader's default collate; never leaves the worker).
    ``samples`` are plain CPU tensors, or NumPy arrays (``arrays=True``) of one shape and
    dtype, which arrive as a tensor, as with ``default_collate``."""

    __slots__ = ("samples", "arrays", "dtype")

    def __init__(self, samples: list[Any], arrays: bool = False) -> None:
        self.samples = samples
        self.arrays = arrays
        self.dtype = torch_dtype(samples[0].dtype) if arrays else samples[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.samples), *self.samples[0].shape)

    def nbytes(self) -> int:
        return self.samples[0].nbytes * len(self.samples)

    @property
    def array_dtype(self) -> np.dtype | None:
        """The NumPy dtype ``write`` takes its target in (None: a tensor)."""
        return self.samples[0].dtype if self.arrays else None

    def write(self, target: Any) -> None:
        if self.arrays:
            stack_arrays(self.samples, target, same_shapes=True)  # slot_collate checked
        else:
            torch.stack(self.samples, out=target)

    def materialize(self) -> torch.Tensor:
        if self.arrays:
            return torch.from_numpy(np.stack(self.samples))
        return torch.stack(self.samples)

    def __reduce__(self) -> tuple:
        # one left inside a container the transport does not walk: sent the old way
        return (_same, (self.materialize(),))


class Gather:
    """Rows of mapped files (``formats.mapped_rows.RowsToGather``) to be gathered straight into
    the slot: one copy (NOTE [ Batches read by columns ]). Arrives as a tensor."""

    __slots__ = ("rows", "dtype")

    def __init__(self, rows: Any) -> None:
        self.rows = rows
        self.dtype = torch_dtype(rows.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rows.shape

    def nbytes(self) -> int:
        return self.rows.nbytes

    @property
    def array_dtype(self) -> np.dtype:
        """The NumPy dtype ``write`` takes its target in."""
        return self.rows.dtype

    def write(self, target: np.ndarray) -> None:
        self.rows.into(target)

    def materialize(self) -> torch.Tensor:
        return torch.from_numpy(self.rows.array())

    def __reduce__(self) -> tuple:
        return (_same, (self.materialize(),))


#: leaves written into the slot by their own ``write`` (``Stack``, ``Gather``)
DEFERRED = (Stack, Gather)


def _same(value: Any) -> Any:
    return value


class SlotCollate:
    """The loader's collate function, then the batch into this worker's slot file.

    Args:
        collate_fn: what collates a list of samples (the user's, or the default one that
            leaves ``Stack`` placeholders).
        fds: one slot file descriptor per worker slot.
        key: the main process's key for these slot files (``receive.register``).
    """

    def __init__(self, collate_fn: Callable[[Any], Any], fds: list[int], key: int) -> None:
        self.collate_fn = collate_fn
        self.fds = fds
        self.key = key
        self._slots: SlotFile | None = None
        self._worker = -1
        # layout -> its pickle: NOTE [ Batch transport ], "Descriptors"
        self._described: dict[tuple, bytes] = {}

    def __getstate__(self) -> dict:
        return {
            "collate_fn": self.collate_fn,
            "fds": [reduce_fd(fd) for fd in self.fds],
            "key": self.key,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["collate_fn"], [restore_fd(fd) for fd in state["fds"]], state["key"])

    def __call__(self, batch: Any) -> Any:
        if type(batch) is LoadedGroup:  # NOTE [ Batches per message ]
            return self._group(batch)
        out = self.collate_fn(batch)
        leaves: list[Any] = []
        skeleton = _flatten(out, leaves)
        if not leaves:
            return out
        return self._send(out, leaves, skeleton)

    def _group(self, loaded: LoadedGroup) -> Any:
        # every batch of the group in one region of at most GROUP_BYTES; each batch fails alone
        outs = Batches()
        for samples in loaded:
            if not isinstance(samples, ExceptionWrapper):
                try:
                    samples = self.collate_fn(samples)
                except Exception:
                    samples = _error_here()
            outs.append(samples)
        leaves: list[Any] = []
        ends = []  # the number of leaves up to each batch's end
        skeleton = Batches()
        for out in outs:
            skeleton.append(out if isinstance(out, ExceptionWrapper) else _flatten(out, leaves))
            ends.append(len(leaves))
        if not leaves:
            return outs
        layout, size = _layout(leaves)
        try:
            if size <= GROUP_BYTES:
                return self._send(outs, leaves, skeleton, (layout, size))
            return self._parts(outs, _cut(layout, size, ends))
        except Exception:  # (the rows are free again): every batch of the group raises it
            return Batches([_error_here()] * len(outs))

    def _parts(self, outs: Batches, cuts: list[int]) -> Parts:
        # NOTE [ Batches per message ], "Memory": batches grown since the group was sized
        parts = Parts()
        try:
            for start, stop in itertools.pairwise([0, *cuts]):
                leaves: list[Any] = []
                skeleton = Batches(
                    out if isinstance(out, ExceptionWrapper) else _flatten(out, leaves)
                    for out in outs[start:stop]
                )
                chunk = Batches(outs[start:stop])
                parts.append(self._send(chunk, leaves, skeleton) if leaves else chunk)
        except BaseException:
            for part in parts:  # sent nowhere: their rows are this worker's again
                if type(part) is SlotBatch:
                    self._slots.table[part.args[2], 0] = FREE
            raise
        return parts

    def _send(self, out: Any, leaves: list[Any], skeleton: Any, sized: tuple | None = None) -> Any:
        slots = self._my_slots()
        if slots is None:
            return _materialized(out)
        layout, size = _layout(leaves) if sized is None else sized
        row = acquire(slots, size)
        if row is None:  # every region is held (a user keeps many batches): the old way
            return _materialized(out)
        offset, capacity = int(slots.table[row, 1]), int(slots.table[row, 2])
        try:
            _write(slots.region(row, offset, capacity), leaves, layout)
        except BaseException:
            slots.table[row, 0] = FREE  # nothing was sent: the row is this worker's again
            raise
        slots.table[row, 0] = READY  # the commit: only now can a descriptor be sent
        described = self._described.get(layout)
        if described is None:
            described = _remember(self._described, layout, pickle.dumps(layout))
        generation = int(slots.table[row, 3])
        return SlotBatch(
            self.key, self._worker, row, offset, capacity, generation, described, skeleton
        )

    def _my_slots(self) -> SlotFile | None:
        if self._slots is None:
            info = get_worker_info()
            if info is None or info.id >= len(self.fds):
                return None
            self._worker = info.id
            self._slots = SlotFile(self.fds[info.id])
            reclaim_torn(self._slots)  # this process replaces a dead worker, or starts
        return self._slots


class SlotBatch:
    """A batch in a slot, as it crosses the pipe: row, layout and the non-array skeleton.
    Unpickled in the main process, it becomes the batch (``receive.rebuild``)."""

    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple:
        return (receive.rebuild, self.args)


def _flatten(value: Any, leaves: list[Any]) -> Any:
    """``value`` with each array leaf replaced by a ``Leaf`` (appended to ``leaves``)."""
    kind = type(value)
    if _is_leaf(value, kind):
        leaves.append(value)
        return Leaf(len(leaves) - 1)
    if kind is list or kind is tuple:
        if plain_values(value):
            return value  # strings, numbers: pickled as they are
        items = [_flatten(item, leaves) for item in value]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {key: _flatten(item, leaves) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(kind, "_fields"):  # a namedtuple
        return kind(*(_flatten(item, leaves) for item in value))
    return value


def _is_leaf(value: Any, kind: type) -> bool:
    # what goes into the slot: plain CPU tensors, arrays of a plain dtype, Stack and Gather
    if kind is torch.Tensor:
        return value.layout == torch.strided and value.device.type == "cpu" and not _special(value)
    return kind in DEFERRED or (kind is np.ndarray and not value.dtype.hasobject)


def _cut(layout: tuple, size: int, ends: list[int]) -> list[int]:
    """Where a group's batches are cut into regions of at most ``GROUP_BYTES`` (a batch
    bigger than that alone): the index after each region's last batch."""
    starts = [entry[3] for entry in layout] + [size]
    cuts = []
    begun = 0  # the offset where the current region begins
    for number, end in enumerate(ends):
        if number and starts[end] - begun > GROUP_BYTES:  # (the region's first batch stays)
            cuts.append(number)
            begun = starts[ends[number - 1]]
    cuts.append(len(ends))
    return cuts


def _special(tensor: torch.Tensor) -> bool:
    # what a plain copy of the bytes would lose: keep those on torch's own path
    return (
        tensor.is_nested
        or tensor.requires_grad
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.is_quantized
        or any(name is not None for name in getattr(tensor, "names", ()))
    )


def _layout(leaves: list[Any]) -> tuple[tuple, int]:
    """(kind, dtype, shape, offset, nbytes) per leaf, and the bytes they take together."""
    layout = []
    offset = 0
    for leaf in leaves:
        if type(leaf) is np.ndarray:
            entry = ("n", leaf.dtype, leaf.shape, offset, leaf.nbytes)
        else:
            entry = ("t", leaf.dtype, tuple(leaf.shape), offset, _nbytes(leaf))
        layout.append(entry)
        offset += -(-entry[4] // ALIGN) * ALIGN
    return tuple(layout), max(offset, 1)


def _nbytes(leaf: Any) -> int:
    return leaf.nbytes() if type(leaf) in DEFERRED else leaf.numel() * leaf.element_size()


def _write(region: Any, leaves: list[Any], layout: tuple) -> None:
    # each leaf's target is a view of the region: a NumPy one where the leaf is written
    # through NumPy, a tensor made through NumPy where NumPy has the dtype (a third of
    # torch.frombuffer and a view)
    for leaf, (kind, dtype, shape, offset, nbytes) in zip(leaves, layout, strict=True):
        if nbytes == 0:
            continue
        deferred = type(leaf) in DEFERRED
        if kind == "n":
            np.copyto(np.ndarray(shape, dtype, region, offset), leaf, casting="no")
            continue
        if deferred and leaf.array_dtype is not None:
            leaf.write(np.ndarray(shape, leaf.array_dtype, region, offset))
            continue
        as_numpy = numpy_dtype(dtype)
        if as_numpy is not None:
            target = torch.from_numpy(np.ndarray(shape, as_numpy, region, offset))
        else:
            count = nbytes // dtype.itemsize
            target = torch.frombuffer(region, dtype=dtype, count=count, offset=offset)
            target = target.view(shape)
        if deferred:
            leaf.write(target)
        else:
            target.copy_(leaf)


#: layouts remembered per worker (ragged batches make a new layout each: then none is kept)
_LAYOUTS_KEPT = 64


def _remember(described: dict[tuple, bytes], layout: tuple, pickled: bytes) -> bytes:
    if len(described) >= _LAYOUTS_KEPT:
        described.clear()
    described[layout] = pickled
    return pickled


def _error_here() -> ExceptionWrapper:
    info = get_worker_info()
    return batch_error(info.id if info else 0)


def _materialized(value: Any) -> Any:
    """``value`` with ``Stack`` placeholders stacked (the batch sent the old way)."""
    kind = type(value)
    if kind in DEFERRED:
        return value.materialize()
    if kind is Batches:
        return Batches(_materialized(item) for item in value)
    if kind is list:
        return [_materialized(item) for item in value]
    if kind is tuple:
        return tuple(_materialized(item) for item in value)
    if kind is dict:
        return {key: _materialized(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return kind(*(_materialized(item) for item in value))
    return value
