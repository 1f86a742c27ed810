"""Collating samples whose fields vary in length: lists, or padding with lengths.

torch's ``default_collate`` stacks every array field of a batch into one tensor, which fails
for ragged fields (a different number of boxes or keypoints per image). ``fastloader.collate``
gives the two usual answers, as ``collate_fn``\\ s for any DataLoader:

- ``ragged_as_lists``: fields whose shapes differ across the batch stay a list of tensors (one
  per sample); everything else is collated as torch does.
- ``pad_ragged(pad_value=0)``: ragged fields are padded to the largest shape in the batch and
  come with their lengths: a dict sample gains ``"<field>_lengths"``; a tuple field becomes
  ``(padded, lengths)``. ``lengths`` is ``(batch,)`` when only the first axis varies (the
  usual case), else ``(batch, ndim)`` of every sample's shape.

``default_collate`` is torch's, except that a batch it cannot stack raises a ``RuntimeError``
naming the field and the shapes met, and pointing here (and a field of PIL images, a
``PILImagesError`` naming where the images are and what converts them for the dataset at
hand: NOTE [ Advice that fits the dataset ]); fastloader.DataLoader uses it when no
``collate_fn`` is given (NOTE [ Naming ragged fields ]).

NOTE [ Naming ragged fields ]
torch's error for a ragged field is "stack expects each tensor to be equal size, but got
[3, 4] at entry 0 and [5, 4] at entry 1", which names neither the field nor a fix. Only when
torch's collate fails do we look at the batch again, find the fields whose shapes differ, and
raise an error that names them; a batch that stacks costs nothing extra.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Subset, get_worker_info
from torch.utils.data import default_collate as torch_default_collate

from fastloader.datasets.columns import ColumnBatch
from fastloader.formats.mapped_rows import PAGE, RowsToGather, address_of, gathered

__all__ = [
    "PILImagesError",
    "RaggedFieldError",
    "default_collate",
    "images_advice",
    "pad_ragged",
    "ragged_as_lists",
]


class RaggedFieldError(RuntimeError):
    """A batch has fields of different shapes that cannot be stacked (the message names them)."""


# NOTE [ Advice that fits the dataset ]
# No collate can stack PIL images, and what turns them into arrays or tensors depends on the
# dataset: a pack's decode=, ImageFolder's transform, a user's own __getitem__. A dataset says
# what applies to it through a method, ``pil_images_advice() -> str`` (packs and ImageFolder
# have one; ``images_advice`` gives the general advice for any other dataset). The collate is
# handed only the batch, so the dataset is found where it runs:
# - in a worker, ``get_worker_info().dataset`` (fastloader points it at the user's dataset):
#   the error leaves the worker complete;
# - in the main process there is no such handle, so the error is raised with the general
#   advice and ``dataset_known=False``; fastloader.DataLoader's iterator, which the error
#   passes through, calls ``for_dataset(loader.dataset)`` to put the dataset's advice in its
#   place. Only on the error path: a batch that stacks pays nothing.
class PILImagesError(TypeError):
    """A batch holds PIL images, which no collate can stack: the message says where they are
    in each sample and what converts them (NOTE [ Advice that fits the dataset ])."""

    what = ""  # where the images are; "" when torch re-raised a worker's error from its text
    dataset_known = True

    @classmethod
    def about(cls, what: str, dataset: Any, dataset_known: bool) -> PILImagesError:
        """The error for images at ``what``, with the advice for ``dataset`` (None: any)."""
        error = cls(f"{what}; {images_advice(dataset)}")
        error.what, error.dataset_known = what, dataset_known
        return error

    def for_dataset(self, dataset: Any) -> None:
        """Put ``dataset``'s advice in the message, if it was raised without it."""
        if self.what and not self.dataset_known:
            self.args = (f"{self.what}; {images_advice(dataset)}",)
            self.dataset_known = True


def images_advice(dataset: Any) -> str:
    """What turns ``dataset``'s PIL images into arrays or tensors: its own
    ``pil_images_advice()``, or advice for any dataset."""
    while isinstance(dataset, Subset):  # a split of a pack or ImageFolder: the same advice
        dataset = dataset.dataset
    advice = getattr(dataset, "pil_images_advice", None)
    if callable(advice):
        return advice()
    return (
        "convert them in the dataset's __getitem__ or its transform (to a uint8 CxHxW tensor "
        "with fastloader.transforms.PILToTensor() or torchvision's pil_to_tensor, or to an "
        "HxWxC array with numpy.asarray), or pass a collate_fn that handles them"
    )


def default_collate(batch: Sequence[Any]) -> Any:
    """torch's ``default_collate``, with an error naming ragged fields and their shapes.

    The same result as torch's; dict samples of NumPy arrays are stacked faster (see
    NOTE [ Stacking NumPy fields ]).

    Raises:
        RaggedFieldError: when a field's arrays differ in shape across the batch.
        TypeError: as torch's; a ``PILImagesError`` (a TypeError) when a field holds PIL
            images, naming it and what converts them.
    """
    if type(batch) is ColumnBatch:  # NOTE [ Batches read by columns ]
        return _collate_columns(batch)
    try:
        if batch and type(batch[0]) is dict:
            return {key: _collate_column([sample[key] for sample in batch]) for key in batch[0]}
        return torch_default_collate(batch)
    except TypeError as error:
        images = [name for name, values in _columns(batch).items() if _all_images(values)]
        if not images:
            raise
        info = get_worker_info()  # NOTE [ Advice that fits the dataset ]
        dataset = info.dataset if info is not None else None
        raise PILImagesError.about(
            _where_images(batch, images), dataset, info is not None
        ) from error
    except RuntimeError as error:
        ragged = _ragged_fields(batch)
        if not ragged:
            raise
        described = "; ".join(
            f"field {name!r} has shapes {_shapes_text(shapes)}" for name, shapes in ragged.items()
        )
        raise RaggedFieldError(
            f"cannot stack the batch: {described}. Variable-length fields need "
            f"collate_fn=fastloader.datasets.collate.ragged_as_lists (a list per field) or "
            f"fastloader.datasets.collate.pad_ragged() (padded, with lengths)"
        ) from error


# NOTE [ Stacking NumPy fields ]
# torch's default_collate turns each sample's NumPy array into a tensor (torch.as_tensor, ~7 us
# each) and then stacks them: for a pose sample of three arrays that is ~1.3 ms of a 64-sample
# batch, more than reading it from a mapped file (issue 18's profile). For a column whose
# values are all plain NumPy arrays of one numeric dtype and shape, np.stack writes them
# straight into the batch tensor: the same values, dtype and shape as torch's
# result. In a worker the tensors (torch.from_numpy, no copy) go to torch's collate, which
# allocates the batch in shared memory: moving a tensor made here into shared memory costs
# about ten times more (a copy and fresh pages: measured 5 ms vs 0.5 ms for 300 KB). Any other
# column, and any other sample structure, goes to torch's default_collate.


#: What a batch carries as plain values, never as tensors: strings, bytes, numbers, None.
SCALAR_TYPES = frozenset((str, bytes, int, float, bool, type(None)))


def plain_values(values: Sequence[Any]) -> bool:
    """Whether ``values`` (a list or tuple) is non-empty and holds only ``SCALAR_TYPES``: one
    set test, no loop in Python (a batch's 64 file names: 8 us less than a loop)."""
    return (
        bool(values)
        and type(values[0]) in SCALAR_TYPES
        and SCALAR_TYPES.issuperset(map(type, values))
    )


#: The default collate functions, torch's and this module's: they draw no random numbers, and
#: cost little next to loading the samples.
DEFAULT_COLLATES = (torch_default_collate, default_collate)


#: NumPy dtype kinds torch takes as they are (in native byte order): bool, ints, floats, complex.
PLAIN_KINDS = "biufc"


def whole(column: Any) -> bool:
    """Whether a ``ColumnBatch`` column becomes its batch tensor whole: rows of a mapped field
    not gathered yet, or a plain numeric array (NOTE [ Batches read by columns ])."""
    if isinstance(column, RowsToGather):
        return True
    return type(column) is np.ndarray and column.dtype.kind in PLAIN_KINDS and column.dtype.isnative


def _collate_columns(batch: ColumnBatch) -> dict[str, Any]:
    in_worker = get_worker_info() is not None  # there torch's collate allocates in shared memory
    try:
        return {
            name: _whole_tensor(column)
            if not in_worker and whole(column)
            else _collate_column(list(gathered(column)))
            for name, column in batch.columns.items()
        }
    except (TypeError, RuntimeError):
        pass  # (outside the handler: the samples' error alone, not chained to this one)
    return default_collate(batch.samples())  # the samples' error, naming the field


def _whole_tensor(column: Any) -> torch.Tensor:
    """A ``ColumnBatch`` column as its batch tensor: mapped rows gathered straight into it
    (NOTE [ Gathered into the batch tensor ]), an array wrapped (no copy)."""
    if not isinstance(column, RowsToGather):
        return torch.from_numpy(column)
    out = np.empty(column.shape, column.dtype)
    tensor = torch.from_numpy(out)
    source = column.source_address() or tensor.data_ptr()
    if 0 < (tensor.data_ptr() - source) % PAGE < _ALIASED:  # moved to the source's alignment
        spare = np.empty(column.nbytes + PAGE, np.uint8)
        at = (source - address_of(spare)) % PAGE
        out = spare[at : at + column.nbytes].view(column.dtype).reshape(column.shape)
        tensor = torch.from_numpy(out)
    column.into(out)
    return tensor


_ALIASED = 64

# NOTE [ Gathered into the batch tensor ]
# In the main process a mapped field's rows are gathered by ``np.take`` straight into a new
# array that becomes the batch tensor (``from_numpy``, no copy), not by NumPy's fancy index:
# ``take`` into an array made first copies row by row without an index buffer (pose images of
# 64, interleaved: 0.67-0.84x the time of the fancy index; ``torch.empty`` as the destination
# was slower than the fancy index, 1.1-1.9x, so the array is NumPy's). A destination whose
# address lies 8-24 bytes past the source's (modulo 4096) makes each row's copy stall on 4K
# aliasing, about 5x slower (450 against 85 us); a large NumPy array can start 16 bytes into
# a page and a pack's data at a page's start (HDF5), so a destination 1-63 bytes past the
# source is made again at the source's own offset in a page (a spare array, a page larger).


def _collate_column(values: list) -> Any:
    first = values[0]
    if type(first) is not np.ndarray or first.dtype.kind not in PLAIN_KINDS:
        return torch_default_collate(values)
    dtype = first.dtype
    if not dtype.isnative or set(map(type, values)) != {np.ndarray}:
        return torch_default_collate(values)  # torch's handling, or its error
    if get_worker_info() is not None:
        # torch's collate allocates the batch in shared memory itself (a tensor made here
        # and moved there later costs ten times more); from_numpy is cheaper than as_tensor
        if len({value.dtype for value in values}) != 1:
            return torch_default_collate(values)
        return torch_default_collate([torch.from_numpy(value) for value in values])
    out = torch.empty((len(values), *first.shape), dtype=_TORCH_DTYPES.get(dtype) or _dtype(dtype))
    try:  # raises for another shape or a dtype that would need a cast
        stack_arrays(values, out.numpy())
    except (ValueError, TypeError):
        return torch_default_collate(values)  # torch's handling, or its error
    return out


def stack_arrays(values: Sequence[np.ndarray], out: np.ndarray, same_shapes: bool = False) -> None:
    """``np.stack(values, out=out, casting="no")`` in about half the time: the shapes are
    checked, then the arrays are concatenated into ``out`` seen as one long array (``stack``
    makes a view per array first). A C-contiguous ``out`` is required for that view; any
    other goes to ``np.stack``. ``same_shapes``: the caller has checked the shapes already.

    Raises:
        ValueError: for arrays of different shapes (or a wrong ``out``).
        TypeError: for a dtype that would need a cast.
    """
    shape = values[0].shape
    if not shape or not out.flags.c_contiguous:
        np.stack(values, out=out, casting="no")
        return
    for value in () if same_shapes else values:
        if value.shape != shape:
            raise ValueError(f"arrays of shapes {shape} and {value.shape} cannot be stacked")
    np.concatenate(values, out=out.reshape((-1, *shape[1:])), casting="no")


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _dtype(dtype: np.dtype) -> torch.dtype:
    _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return _TORCH_DTYPES[dtype]


def ragged_as_lists(batch: Sequence[Any]) -> Any:
    """Collate as torch does, but keep each ragged field as a list of per-sample tensors."""
    return _collate(batch, lambda name, values: [_tensor(value) for value in values])


def pad_ragged(pad_value: float = 0) -> Callable[[Sequence[Any]], Any]:
    """A ``collate_fn`` padding ragged fields to the batch's largest shape, with lengths.

    Nothing is cast or overwritten silently (NOTE [ Padding never changes data ]).

    Args:
        pad_value: what the padding holds; it must be exactly representable in every padded
            field's dtype (``-1`` in a uint8 field is refused, not stored as 255).

    Raises:
        TypeError: at once, for a ``pad_value`` that is not a number.
        RaggedFieldError: when collating, for a ragged field whose samples differ in dtype or
            number of dimensions.
        ValueError: when collating, for a ``pad_value`` the field's dtype cannot hold, or a
            dict sample that already has a ``"<field>_lengths"`` field.
    """
    if not isinstance(pad_value, (bool, int, float)):
        raise TypeError(f"pad_value must be a number, got {type(pad_value).__name__}")

    def pad(name: str, values: list) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = [_tensor(value) for value in values]
        _check_paddable(name, tensors, pad_value)
        shapes = torch.tensor([list(tensor.shape) for tensor in tensors], dtype=torch.int64)
        largest = shapes.max(dim=0).values.tolist()
        padded = tensors[0].new_full((len(tensors), *largest), pad_value)
        for at, tensor in enumerate(tensors):
            padded[(at, *(slice(0, length) for length in tensor.shape))] = tensor
        varies = (shapes != shapes[0]).any(dim=0)
        lengths = shapes[:, 0] if varies.sum() <= 1 and bool(varies[0]) else shapes
        return padded, lengths

    def collate(batch: Sequence[Any]) -> Any:
        return _collate(batch, pad, padded=True)

    return collate


# NOTE [ Padding never changes data ]
# pad_ragged used to build the batch with the first sample's dtype (a float32 sample after an
# int64 one was truncated to integers), to store a pad value the dtype cannot hold as whatever
# the cast made of it (-1 in uint8 is 255, a real pixel value), and to write the lengths of
# field "x" over a field the sample already called "x_lengths". Each is now refused, naming
# the field: samples of one field must share dtype and number of dimensions, the pad value
# must come back unchanged from the dtype (integers in range, 0 or 1 for bool, no overflow
# to infinity for floats), and the lengths' key must be free.
def _check_paddable(name: str, tensors: list, pad_value: float) -> None:
    dtypes = {tensor.dtype for tensor in tensors}
    if len(dtypes) > 1:
        listed = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes))
        raise RaggedFieldError(
            f"field {name!r} mixes dtypes ({listed}) across the batch: pad_ragged does not "
            f"cast; give every sample one dtype"
        )
    if len({tensor.dim() for tensor in tensors}) > 1:
        raise RaggedFieldError(
            f"field {name!r} mixes numbers of dimensions across the batch "
            f"({_shapes_text([tuple(tensor.shape) for tensor in tensors])}): it cannot be padded"
        )
    dtype = tensors[0].dtype
    if not _holds(dtype, pad_value):
        raise ValueError(
            f"pad_value {pad_value!r} cannot be stored in field {name!r} of dtype "
            f"{str(dtype).removeprefix('torch.')}: the padding would hold another value"
        )


def _holds(dtype: torch.dtype, value: float) -> bool:
    """Whether ``value`` is stored in ``dtype`` unchanged (floats: without overflowing)."""
    if dtype == torch.bool:
        return value in (0, 1)
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        whole = isinstance(value, int) or math.isfinite(value) and float(value).is_integer()
        return whole and info.min <= value <= info.max
    try:
        stored = torch.tensor(value, dtype=dtype)
    except (RuntimeError, OverflowError):  # an int too large for any float
        return False
    return bool(torch.isfinite(stored).all()) or not math.isfinite(value)


def _collate(batch: Sequence[Any], ragged: Callable, padded: bool = False) -> Any:
    first = batch[0]
    if isinstance(first, Mapping):
        out = {}
        for key in first:
            values = [sample[key] for sample in batch]
            if _is_ragged(values):
                if padded and f"{key}_lengths" in first:  # NOTE [ Padding never changes data ]
                    raise ValueError(
                        f"field {key!r} is ragged and the samples already have a field "
                        f"'{key}_lengths', where pad_ragged puts its lengths: rename one"
                    )
                result = ragged(key, values)
                if padded:
                    out[key], out[f"{key}_lengths"] = result
                else:
                    out[key] = result
            else:
                out[key] = torch_default_collate(values)
        return out
    if isinstance(first, (tuple, list)):
        columns = list(zip(*batch, strict=True))
        out = [
            ragged(str(at), list(values))
            if _is_ragged(values)
            else torch_default_collate(list(values))
            for at, values in enumerate(columns)
        ]
        return tuple(out) if isinstance(first, tuple) else out
    return torch_default_collate(batch)


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return tuple(value.shape)
    return None


def _is_ragged(values: Sequence[Any]) -> bool:
    shapes = {_shape(value) for value in values}
    return None not in shapes and len(shapes) > 1


def _columns(batch: Sequence[Any]) -> dict[str, list]:
    """The batch's values per field: dict keys, tuple positions, or the whole sample."""
    first = batch[0]
    if isinstance(first, Mapping):
        return {str(key): [sample[key] for sample in batch] for key in first}
    if isinstance(first, (tuple, list)):
        return {str(at): list(values) for at, values in enumerate(zip(*batch, strict=True))}
    return {"sample": list(batch)}


def _ragged_fields(batch: Sequence[Any]) -> dict[str, list]:
    return {
        name: [_shape(value) for value in values]
        for name, values in _columns(batch).items()
        if _is_ragged(values)
    }


def _all_images(values: list) -> bool:
    return bool(values) and all(isinstance(value, Image.Image) for value in values)


def _where_images(batch: Sequence[Any], fields: list[str]) -> str:
    """Where a batch's PIL images are: "element 0 of each sample (a tuple) is a PIL.Image"."""
    first = batch[0]
    kind = type(first).__name__
    if isinstance(first, Mapping):
        where = " and ".join(f"field {name!r}" for name in fields) + f" of each sample (a {kind})"
    elif isinstance(first, (tuple, list)):
        where = "element " + " and ".join(fields) + f" of each sample (a {kind})"
    else:
        where = "each sample"
    verb = "are" if len(fields) > 1 else "is"
    return f"default_collate cannot stack PIL images: {where} {verb} a PIL.Image"


def _shapes_text(shapes: list) -> str:
    distinct = list(dict.fromkeys(shapes))
    shown = ", ".join(str(list(shape)) for shape in distinct[:4])
    return shown + (f" and {len(distinct) - 4} more" if len(distinct) > 4 else "")


def _tensor(value: Any) -> torch.Tensor:
    return torch.as_tensor(value) if isinstance(value, np.ndarray) else value
