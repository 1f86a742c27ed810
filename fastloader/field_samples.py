"""Reading a pack of any sample: a FIELDS record back to the dict or tuple that was packed.

Runs in whichever process reads, for ``PackedDataset`` (datasets.py) over a format-4 pack. The
payload codec is torch-free (formats/fields.py); this decodes image fields as the dataset's
``decode`` mode says, with fused decoding when ``transform`` allows it (NOTE [ Fused decoding ]
in decoding.py), and applies the transforms.

NOTE [ Transforms of a pack of fields ]
``transform`` is what torchvision users pass for images, so it goes to the pack's image field
(the first one, in schema order), fused with decoding where it can be; a pack without an image
field gives it the whole sample. ``sample_transform`` then sees the whole sample (the dict or
tuple), to move boxes and keypoints with the image or to build the training tuple.
``target_transform`` belongs to (image, label) packs and is refused here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastloader.decoding import fuse
from fastloader.formats.fields import IMAGE_RAW, FieldsDecoder
from fastloader.formats.records import PackError, Record, RecordKind

__all__ = ["check_fields_options", "load_fields"]


def check_fields_options(dataset: Any) -> str | None:
    """The image field ``transform`` goes to (None: the whole sample, or an image pack).

    Raises:
        ValueError: for ``target_transform`` on a pack of fields, or ``sample_transform`` on a
            pack of (image, label).
    """
    if dataset.schema is None:
        if dataset.sample_transform is not None:
            raise ValueError(
                f"{dataset.path}: sample_transform is for packs of fields; this pack holds "
                f"(image, label) samples: use transform and target_transform"
            )
        return None
    if dataset.target_transform is not None:
        raise ValueError(
            f"{dataset.path}: target_transform is for (image, label) packs; this pack holds "
            f"samples of fields: use sample_transform (NOTE [ Transforms of a pack of fields ])"
        )
    images = [field["name"] for field in dataset.schema["fields"] if field["kind"] == "image"]
    return images[0] if images else None


def load_fields(dataset: Any, position: int, buffer: Any) -> Any:
    """Decode and transform record ``position`` of a pack of fields, checksum verified."""
    from fastloader.datasets import decode_image  # datasets.py imports this module

    where = f"{dataset.path} record {position}"
    mode = dataset.decode
    target = dataset._image_field
    fused = fuse(dataset.transform) if target is not None and mode != "bytes" else None

    def image(stored: int, shape: Any, data: memoryview, name: str) -> Any:
        kind = RecordKind.RAW if stored == IMAGE_RAW else RecordKind.ENCODED
        record = Record(0, kind, shape, data)
        if name != target or fused is None:
            return decode_image(record, mode, f"{where} field {name!r}")
        if kind is RecordKind.RAW:
            return fused.apply_raw(np.frombuffer(data, dtype=np.uint8).reshape(shape), mode)
        plain = lambda: decode_image(record, mode, f"{where} field {name!r}")  # noqa: E731
        return fused.apply_encoded(data, plain, mode)

    decoder = dataset.__dict__.get("_fields_decoder")
    if decoder is None:
        decoder = dataset._fields_decoder = FieldsDecoder(dataset.schema)

    def decode(record: Record) -> Any:
        if record.kind is not RecordKind.FIELDS:
            raise PackError(f"{where}: an image record in a pack of fields (corrupt pack)")
        return decoder.decode(record.payload, where, image)

    sample = dataset._checked(position, buffer, decode)
    if dataset.transform is not None and fused is None:
        if target is None:
            sample = dataset.transform(sample)
        elif isinstance(sample, dict):
            sample[target] = dataset.transform(sample[target])
        else:
            at = _index_of(dataset.schema, target)
            sample = _replaced(sample, at, dataset.transform(sample[at]))
    if dataset.sample_transform is not None:
        sample = dataset.sample_transform(sample)
    return sample


def _index_of(schema: dict, name: str) -> int:
    return [field["name"] for field in schema["fields"]].index(name)


def _replaced(sample: tuple | list, at: int, value: Any) -> tuple | list:
    items = list(sample)
    items[at] = value
    return tuple(items) if isinstance(sample, tuple) else items
