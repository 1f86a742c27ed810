"""Reading a pack of any sample: a FIELDS record back to the dict or tuple that was packed.

Runs in whichever process reads, for ``PackedDataset`` (datasets.py) over a format-4 pack. The
payload codec is torch-free (formats/fields.py); this decodes image fields as the dataset's
``decode`` mode says, with fused decoding when ``transform`` allows it (NOTE [ Fused decoding ]
in decoding.py), and applies the transforms.

NOTE [ Transforms of a pack of fields ]
``transform`` gets the whole sample (the dict or tuple), images decoded as ``decode`` says,
as a user's file read in place gives it to ``transform`` (NOTE [ One meaning per argument ]).
``image_transform`` goes to the pack's image field (the first one, in schema order), fused
with decoding where it can be: what torchvision users pass for images (it is what
``transform`` meant before format 5's release). ``sample_transform`` then sees the whole
sample again (kept for code written for that release). ``target_transform`` belongs to
(image, label) packs and is refused here.

NOTE [ One meaning per argument ]
A pack made from a user's file reads back as the file does: ``transform=`` receives the
whole sample, images come back as uint8 HxWxC arrays (``decode`` defaults to "numpy" for a
pack of fields; "pil" gives PIL images, the earlier default), and the default collate makes
the same batch. With no per-sample code (no ``transform``, ``image_transform``,
``sample_transform`` or ``with_geometry``), ``decode`` "numpy" or "tensor", dict samples and
images stored raw at one size, a pack laid out by columns gives the loader whole batches by
column (``read_columns``), as ``HDF5FileDataset`` does. ``(image, label)`` packs keep
torchvision's ``ImageFolder`` meaning: ``transform`` for the image, ``decode="pil"``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastloader.datasets.columns import ColumnBatch
from fastloader.formats.column_reader import checked_rows
from fastloader.formats.fields import IMAGE_RAW, FieldsDecoder
from fastloader.formats.mapped_rows import gathered
from fastloader.formats.records import PackError, Record, RecordKind
from fastloader.vision.decoding import fuse
from fastloader.vision.stored_images import decode_image

__all__ = ["check_fields_options", "load_column_samples", "load_fields", "read_columns"]


def check_fields_options(dataset: Any) -> str | None:
    """The image field ``transform`` goes to (None: the whole sample, or an image pack).

    Raises:
        ValueError: for ``target_transform`` on a pack of fields, or ``sample_transform`` on a
            pack of (image, label).
    """
    if dataset.schema is None:
        if dataset.with_geometry:
            raise ValueError(f"{dataset.path}: with_geometry is for packs of fields")
        if dataset.image_transform is not None:
            raise ValueError(
                f"{dataset.path}: image_transform is for packs of fields; this pack holds "
                f"(image, label) samples: use transform"
            )
        if dataset.sample_transform is not None:
            raise ValueError(
                f"{dataset.path}: sample_transform is for packs of fields; this pack holds "
                f"(image, label) samples: use transform and target_transform"
            )
        return None
    if dataset.with_geometry and dataset.schema["structure"] != "dict":
        raise ValueError(f"{dataset.path}: with_geometry needs dict samples")
    if dataset.target_transform is not None:
        raise ValueError(
            f"{dataset.path}: target_transform is for (image, label) packs; this pack holds "
            f"samples of fields: use sample_transform (NOTE [ Transforms of a pack of fields ])"
        )
    images = [field["name"] for field in dataset.schema["fields"] if field["kind"] == "image"]
    if dataset.image_transform is not None and not images:
        raise ValueError(f"{dataset.path}: image_transform needs an image field; use transform")
    return images[0] if images else None


def load_fields(dataset: Any, position: int, buffer: Any) -> Any:
    """Decode and transform record ``position`` of a pack of fields, checksum verified."""
    return _reader(dataset).load(position, buffer)


def _reader(dataset: Any) -> _FieldsReader:
    reader = dataset.__dict__.get("_fields_reader")
    if reader is None or reader.key != (dataset.image_transform, dataset.decode):
        reader = dataset._fields_reader = _FieldsReader(dataset)  # not pickled: see datasets.py
    return reader


def load_column_samples(
    dataset: Any,
    indices: Sequence[int],
    positions: list[int],
    before_each: Callable[[int], None] | None,
) -> list:
    """The samples at ``positions`` of a pack laid out by columns, decoded and transformed one
    by one, ``before_each(index)`` called before each (the loader seeds there); their blocks'
    checksums verified first (NOTE [ Blocks checked once per process ])."""
    table = dataset.column_table()
    if dataset.verify_checksums:
        table.check_rows(np.asarray(positions, dtype=np.int64))
    reader = _reader(dataset)
    out = []
    for index, row in zip(indices, positions, strict=True):
        if before_each is not None:
            before_each(index)
        out.append(reader.finish(table.sample(row, reader.image)))
    return out


def _by_columns(dataset: Any) -> bool:
    """Whether the dataset's batches can be read by column (NOTE [ One meaning per argument ])."""
    if (
        dataset.layout != "columns"
        or dataset.schema["structure"] != "dict"
        or dataset.transform is not None
        or dataset.image_transform is not None
        or dataset.sample_transform is not None
        or dataset.with_geometry
    ):
        return False
    columns = dataset.metadata["columns"]["fields"]
    images = [
        column
        for field, column in zip(dataset.schema["fields"], columns, strict=True)
        if field["kind"] == "image"
    ]
    if not images:
        return True
    fixed = all(column["storage"] == "fixed" for column in images)
    return fixed and dataset.decode in ("numpy", "tensor")


def read_columns(dataset: Any, indices: Sequence[int]) -> ColumnBatch | None:
    """The samples ``indices`` as a ``ColumnBatch``, or None where they need per-sample work
    (NOTE [ One meaning per argument ]): fixed fields are gathered by rows, images as
    ``decode`` says ("tensor": CHW)."""
    key = (
        dataset.transform,
        dataset.image_transform,
        dataset.sample_transform,
        dataset.with_geometry,
        dataset.decode,
    )
    plan = dataset.__dict__.get("_columns_plan")
    if plan is None or plan[0] != key:  # planned once per dataset and arguments
        plan = dataset._columns_plan = (key, _plan_columns(dataset))
    names = plan[1]
    if names is None or not len(indices):
        return None
    rows = checked_rows(indices, len(dataset), dataset.path)
    table = dataset.column_table()
    if dataset.verify_checksums:
        table.check_rows(rows)
    batch = {name: table.batch(number, rows) for number, (name, _) in enumerate(names)}
    for name, chw in names:
        if chw:
            batch[name] = np.ascontiguousarray(gathered(batch[name]).transpose(0, 3, 1, 2))
    return ColumnBatch(batch, len(rows))


def _plan_columns(dataset: Any) -> list[tuple[str, bool]] | None:
    """Each field's name and whether it is an image given as CHW; None: not by columns."""
    if not _by_columns(dataset):
        return None
    tensors = dataset.decode == "tensor"
    return [
        (field["name"], tensors and field["kind"] == "image") for field in dataset.schema["fields"]
    ]


class _FieldsReader:
    """What reading a pack of fields needs, planned once per dataset (and transform)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.key = (dataset.image_transform, dataset.decode)
        self.mode = dataset.decode
        self.target = dataset._image_field
        use_fused = self.target is not None and self.mode != "bytes"
        self.fused = fuse(dataset.image_transform) if use_fused else None
        self.decoder = FieldsDecoder(dataset.schema)
        self.geometry: dict | None = None  # of the last image: NOTE [ Crop box and flip ]
        self.with_geometry = dataset.with_geometry
        if self.fused is not None and self.with_geometry:
            self.fused = _recording(self.fused, self)

    def load(self, position: int, buffer: Any) -> Any:
        dataset = self.dataset
        where = f"{dataset.path} record {position}"

        def decode(record: Record) -> Any:
            if record.kind is not RecordKind.FIELDS:
                raise PackError(f"{where}: an image record in a pack of fields (corrupt pack)")
            return self.decoder.decode(record.payload, where, self.image)

        self.geometry = None
        return self.finish(dataset._checked(position, buffer, decode))

    def finish(self, sample: Any) -> Any:
        """A decoded sample, transformed (NOTE [ Transforms of a pack of fields ])."""
        dataset = self.dataset
        image_transform, target = dataset.image_transform, self.target
        if self.with_geometry and isinstance(sample, dict):
            sample[f"{target}_geometry"] = self.geometry
            self.geometry = None
        if image_transform is not None and self.fused is None:
            if isinstance(sample, dict):
                sample[target] = image_transform(sample[target])
            else:
                at = _index_of(dataset.schema, target)
                sample = _replaced(sample, at, image_transform(sample[at]))
        if dataset.transform is not None:
            sample = dataset.transform(sample)
        if dataset.sample_transform is not None:
            sample = dataset.sample_transform(sample)
        return sample

    def image(self, stored: int, shape: Any, data: memoryview, name: str) -> Any:
        """An image field's value, as the dataset's ``decode`` mode (and fused transform) say."""
        fused = self.fused if name == self.target else None
        if stored == IMAGE_RAW:
            if fused is not None:
                return fused.apply_raw(np.frombuffer(data, np.uint8).reshape(shape), self.mode)
            if self.mode == "numpy":
                return np.frombuffer(data, np.uint8).reshape(shape).copy()
        record = Record(
            0, RecordKind.RAW if stored == IMAGE_RAW else RecordKind.ENCODED, shape, data
        )
        where = f"{self.dataset.path} field {name!r}"
        if fused is None:
            return decode_image(record, self.mode, where)
        plain = lambda: decode_image(record, self.mode, where)  # noqa: E731
        return fused.apply_encoded(data, plain, self.mode)


# NOTE [ Crop box and flip ]
# A fused transform crops, resizes and flips the image field while decoding it; boxes and
# keypoints must follow, and only the user's code knows them. With `with_geometry=True` a dict
# sample gets "<image field>_geometry": the box that was cut from the stored image (left, top,
# width, height, in its pixels, as floats), the size it was resized to (out_height,
# out_width), whether it was then mirrored (flip), and the stored image's size (source_height,
# source_width); None when the transform did not run fused. A point (x, y) of the stored image
# lands at ((x - left) * out_width / width, (y - top) * out_height / height), then
# x -> out_width - x if flip. The box is recorded by wrapping the fused transform's own draw
# (a copy of it, held by this reader only), so the draws are the ones that made the image.


def _recording(fused: Any, reader: _FieldsReader) -> Any:
    recorder = copy.copy(fused)
    draw = fused.draw

    def recording_draw(height: int, width: int) -> Any:
        geometry = draw(height, width)
        if geometry is not None:
            reader.geometry = {
                "left": geometry.left,
                "top": geometry.top,
                "width": geometry.width,
                "height": geometry.height,
                "out_height": geometry.out_height,
                "out_width": geometry.out_width,
                "flip": bool(geometry.flip),
                "source_height": height,
                "source_width": width,
            }
        return geometry

    recorder.draw = recording_draw
    return recorder


def _index_of(schema: dict, name: str) -> int:
    return [field["name"] for field in schema["fields"]].index(name)


def _replaced(sample: tuple | list, at: int, value: Any) -> tuple | list:
    items = list(sample)
    items[at] = value
    return tuple(items) if isinstance(sample, tuple) else items
