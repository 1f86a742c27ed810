"""Packing samples of many fields: the schema from sample 0, each sample checked and encoded.

The schema is inferred in the main process from the first sample (``infer_schema``; the
user's ``schema=`` overrides or completes it); ``FieldsEncoder`` runs in the packing workers
(NOTE [ Packing workers ] in packing/worker.py) and turns each sample into one FIELDS record
(NOTE [ Fields payload ] in formats/fields.py), raising for a sample that does not fit the
schema, naming its index and the field. An image that cannot be read skips the sample, as it
does in a pack of (image, label).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from fastloader.formats import RecordKind, decode_record, encode_record
from fastloader.formats.bounded_json import dump_exact
from fastloader.formats.fields import (
    FIELD_KINDS,
    IMAGE_ENCODED,
    IMAGE_RAW,
    check_schema,
    encode_array,
    encode_fields,
    encode_image,
    encode_scalar,
)
from fastloader.formats.packfile import is_tensor
from fastloader.packing.worker import Encoded, Options, _as_image, _encode_bytes, _reason
from fastloader.packing.worker import encode_image as encode_image_record
from fastloader.vision.images import strict_decoding

__all__ = ["FieldsEncoder", "SampleSchemaError", "infer_schema", "is_fields_sample"]

MAX_JSON_BYTES = 1 << 20  # "small JSON": a record is one sample, not a side file
_IMAGE_STARTS = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"RIFF")


class SampleSchemaError(ValueError):
    """A sample does not fit the pack's schema (the message names its index and the field)."""


def is_fields_sample(sample: Any) -> bool:
    """Whether ``sample`` needs a pack of fields: anything but an ``(image, int label)`` pair."""
    if isinstance(sample, Mapping):
        return True
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        return isinstance(sample, (tuple, list))
    image, label = sample
    label_ok = isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_))
    return not (label_ok and _image_like(image, declared=False))


def _image_like(value: Any, *, declared: bool) -> bool:
    if isinstance(value, Image.Image):
        return True
    if isinstance(value, (bytes, bytearray, memoryview)):
        return declared or bytes(value[:8]).startswith(_IMAGE_STARTS)
    if is_tensor(value):
        return str(value.dtype) == "torch.uint8" and value.ndim in (2, 3)
    if isinstance(value, np.ndarray):
        return value.dtype == np.uint8 and value.ndim in (2, 3)
    return False


def infer_schema(sample: Any, schema: Mapping | None = None) -> dict[str, Any]:
    """The schema of a pack whose first sample is ``sample``.

    Args:
        sample: a dict of fields (str keys) or a tuple/list of fields.
        schema: a whole schema (``{"structure": ..., "fields": [...]}``), or ``{field: kind}``
            for the fields whose kind is not what inference gives (e.g. ``{"image": "image"}``
            for a uint8 array to store as an image; tuple fields are named "0", "1", ...).

    Raises:
        SampleSchemaError: naming the field whose value cannot be stored.
        ValueError: for a schema that names unknown fields or kinds.
    """
    if schema is not None and "fields" in schema:
        return check_schema(dict(schema), "schema=")
    overrides = {str(name): kind for name, kind in (schema or {}).items()}
    names, values, structure = _fields_of(sample, 0)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"schema= names fields the samples do not have: {unknown}")
    fields = []
    for name, value in zip(names, values, strict=True):
        kind = overrides.get(name) or _kind_of(value, name)
        if kind not in FIELD_KINDS:
            raise ValueError(f"schema=: field {name!r} has kind {kind!r}, not one of {FIELD_KINDS}")
        field = {"name": name, "kind": kind}
        if kind == "array":
            array = _as_array(value, name, 0)
            field.update(dtype=array.dtype.newbyteorder("<").str, ndim=array.ndim)
        fields.append(field)
    return check_schema({"structure": structure, "fields": fields}, "schema=")


def _fields_of(sample: Any, index: int) -> tuple[list[str], list[Any], str]:
    if isinstance(sample, Mapping):
        keys = list(sample)
        if not all(isinstance(key, str) for key in keys):
            raise SampleSchemaError(f"sample {index}: dict samples need str keys, got {keys}")
        return keys, list(sample.values()), "dict"
    if isinstance(sample, (tuple, list)):
        structure = "list" if isinstance(sample, list) else "tuple"
        return [str(at) for at in range(len(sample))], list(sample), structure
    raise SampleSchemaError(
        f"sample {index}: expected a dict or tuple of fields, got {type(sample).__name__}"
    )


def _kind_of(value: Any, name: str) -> str:
    if isinstance(value, Image.Image):
        return "image"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "image" if _image_like(value, declared=False) else "bytes"
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, np.ndarray) or is_tensor(value):
        return "array"
    if value is None or isinstance(value, (dict, list)):
        return "json"
    raise SampleSchemaError(
        f"sample 0 field {name!r}: cannot store a {type(value).__name__} (use arrays, numbers, "
        f"str, bytes, images, or JSON-able dicts and lists)"
    )


def _as_array(value: Any, name: str, index: int) -> np.ndarray:
    if is_tensor(value):
        try:
            value = value.detach().cpu().numpy()
        except (TypeError, RuntimeError) as error:  # bfloat16, quantized...: no NumPy dtype
            raise SampleSchemaError(
                f"sample {index} field {name!r}: a tensor NumPy cannot hold ({error})"
            ) from None
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biufc":
        what = getattr(value, "dtype", type(value).__name__)
        raise SampleSchemaError(f"sample {index} field {name!r}: not a numeric array ({what})")
    return value


class FieldsEncoder:
    """Encodes the sample at a dataset index into one FIELDS record (or skips it for an image
    that cannot be read); raises ``SampleSchemaError`` naming the index and the field for a
    sample that does not fit the schema."""

    def __init__(self, dataset: Any, options: Options, schema: dict[str, Any]) -> None:
        self.dataset = dataset
        self.options = options
        self.schema = schema

    def __call__(self, index: int) -> Encoded:
        sample = self.dataset[index]
        names, values, structure = _fields_of(sample, index)
        expected = [field["name"] for field in self.schema["fields"]]
        if structure != self.schema["structure"] or names != expected:
            raise SampleSchemaError(
                f"sample {index}: its fields {names} ({structure}) differ from sample 0's "
                f"{expected} ({self.schema['structure']})"
            )
        encoded = []
        for field, value in zip(self.schema["fields"], values, strict=True):
            if field["kind"] == "image":
                try:
                    encoded.append(self._image(value, index, field["name"]))
                except SampleSchemaError:
                    raise
                except Exception as error:
                    return Encoded(None, 0, f"field {field['name']!r}: {_reason(error)}")
            else:
                encoded.append(_encode_value(field, value, index))
        return Encoded(encode_record(encode_fields(encoded), 0, RecordKind.FIELDS), 0, None)

    def _image(self, value: Any, index: int, name: str) -> bytes:
        if not _image_like(value, declared=True):
            what = getattr(value, "shape", type(value).__name__)
            raise SampleSchemaError(
                f"sample {index} field {name!r}: not an image (a PIL image, image file bytes, "
                f"or a uint8 HW/HWC array or HW/CHW tensor), got {what}"
            )
        options = self.options
        if (
            options.store == "raw"
            and options.max_side is None
            and options.short_side is None
            and type(value) is np.ndarray
            and value.dtype == np.uint8
            and value.ndim == 3
            and value.shape[2] == 3
        ):  # RGB pixels stored as they are: what the PIL round trip below would store
            return encode_image(IMAGE_RAW, value.shape, np.ascontiguousarray(value).tobytes())
        try:
            image = _as_image(value, index)
        except TypeError as error:
            raise SampleSchemaError(f"{error} (field {name!r})") from None
        if isinstance(image, bytes):
            record = _encode_bytes(image, 0, self.options)
        else:
            with strict_decoding():
                image.load()
            record = encode_image_record(image, 0, self.options)
        parsed = decode_record(record, verify=False)
        stored = IMAGE_RAW if parsed.kind is RecordKind.RAW else IMAGE_ENCODED
        return encode_image(stored, parsed.shape, parsed.payload)


def _encode_value(field: dict, value: Any, index: int) -> bytes:
    kind, name = field["kind"], field["name"]
    where = f"sample {index} field {name!r}"
    if kind == "array":
        return _encode_array_value(field, value, index)
    value = _plain_scalar(value, kind)
    _check_kind(value, kind, where)
    if kind == "json":
        return _encode_json(value, where)
    if kind == "float":
        return encode_scalar(kind, _exact_float(value, where))
    return encode_scalar(kind, value)


def _encode_array_value(field: dict, value: Any, index: int) -> bytes:
    name = field["name"]
    array = _as_array(value, name, index)
    dtype = np.dtype(field["dtype"])
    if array.dtype.newbyteorder("<") != dtype or array.ndim != field["ndim"]:
        raise SampleSchemaError(
            f"sample {index} field {name!r}: {array.dtype} array of shape {array.shape}; the "
            f"schema (from sample 0) says {dtype} with {field['ndim']} dimensions"
        )
    return encode_array(array, dtype)


_NUMBERS = ("int", "float", "bool")


def _plain_scalar(value: Any, kind: str) -> Any:
    """A one-element tensor or a NumPy scalar of a number field as its Python number."""
    if kind in _NUMBERS and is_tensor(value) and value.numel() == 1:
        return value.item()
    if kind in _NUMBERS and isinstance(value, np.generic):
        return value.item()
    return value


_FITS = {
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "float": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "bool": lambda value: isinstance(value, bool),
    "str": lambda value: isinstance(value, str),
    "bytes": lambda value: isinstance(value, (bytes, bytearray, memoryview)),
    "json": lambda value: True,
}


def _check_kind(value: Any, kind: str, where: str) -> None:
    if not _FITS[kind](value):
        raise SampleSchemaError(f"{where}: a {type(value).__name__}; the schema says {kind}")
    if kind == "int" and not -(1 << 63) <= value < 1 << 63:
        raise SampleSchemaError(f"{where}: {value} does not fit in 64 bits")


def _encode_json(value: Any, where: str) -> bytes:
    try:
        encoded = dump_exact(value)  # what reads back equal, or refused
    except ValueError as error:
        raise SampleSchemaError(f"{where}: {error}") from None
    if len(encoded) > MAX_JSON_BYTES:
        raise SampleSchemaError(f"{where}: {len(encoded)} bytes of JSON (at most 1 MiB)")
    return encoded


def _exact_float(value: int | float, where: str) -> float:
    """``value`` as the float64 that reads back equal to it, or SampleSchemaError."""
    try:
        stored = float(value)
    except OverflowError:
        bits = value.bit_length() if isinstance(value, int) else "?"
        raise SampleSchemaError(
            f"{where}: an int of {bits} bits is too large for a float64 field"
        ) from None
    if isinstance(value, int) and stored != value:
        raise SampleSchemaError(
            f"{where}: the int {value} has no exact float64 (it would read back as {stored!r})"
        )
    return stored
