"""Samples of many fields in one record: the schema, and the payload codec (torch-free).

A pack of any sample (format 4) stores each sample as one record of kind ``FIELDS`` whose
payload holds every field of the sample, so the record checksum (bound to the position, NOTE
[ Checksums bound to positions ] in records.py) covers every field. The schema, kept in the
metadata under ``"schema"`` (and so under the metadata checksum), says how to read them::

    {"structure": "dict" | "tuple" | "list",
     "fields": [{"name": "boxes", "kind": "array", "dtype": "<f4", "ndim": 2}, ...]}

Kinds: ``image`` (encoded file bytes or raw uint8 HWC pixels, as image records), ``array``
(any numeric or bool dtype, a fixed number of axes, any length along each per sample),
``int`` (int64), ``float`` (float64), ``bool``, ``str`` (UTF-8), ``bytes`` and ``json`` (small
JSON-able values, parsed bounded as metadata is). Never pickle.

NOTE [ Fields payload ]
The payload is ``u32 field count``, then one ``u64`` end offset per field (relative to the
first byte after the table), then the fields' bytes back to back, in schema order:
``array``: ``ndim`` u64 dimensions, then the elements (little-endian as the schema's dtype);
``image``: u8 kind (0 encoded, 1 raw), 3 zero bytes, u32 height, width, channels (0 for
encoded), then the bytes; ``int``/``float``: 8 bytes (``<i8``/``<f8``); ``bool``: 1 byte;
``str``/``json``: UTF-8; ``bytes``: as is. A reader checks the table (count, offsets increasing,
the last equal to the payload) and each field's size against its header before it reads, so a
damaged payload is a PackError naming the record and the field, never a read past the record
or an allocation beyond it; the checksum (verified right after: NOTE [ Checksum after the
copy ]) then says whether the bytes are the ones written.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.bounded_json import parse_json
from fastloader.formats.records import PackError

__all__ = [
    "FIELD_KINDS",
    "IMAGE_ENCODED",
    "IMAGE_RAW",
    "FieldsDecoder",
    "check_schema",
    "decode_fields",
]

FIELD_KINDS = ("image", "array", "int", "float", "bool", "str", "bytes", "json")
STRUCTURES = ("dict", "tuple", "list")
IMAGE_ENCODED, IMAGE_RAW = 0, 1
MAX_FIELDS = 1024
MAX_NDIM = 32
_COUNT = struct.Struct("<I")
_IMAGE = struct.Struct("<B3xIII")
_SCALARS = {"int": struct.Struct("<q"), "float": struct.Struct("<d"), "bool": struct.Struct("<?")}


def check_schema(schema: Any, path: Path | str) -> dict[str, Any]:
    """Return ``schema`` (from a pack's metadata) after checking every part of it.

    Raises:
        PackError: naming the file and what is wrong.
    """
    where = f"{path}: corrupt metadata (schema"
    if not isinstance(schema, dict) or schema.get("structure") not in STRUCTURES:
        raise PackError(f"{where} is not an object with a known structure)")
    fields = schema.get("fields")
    if not isinstance(fields, list) or not 0 < len(fields) <= MAX_FIELDS:
        raise PackError(f"{where}: no list of fields)")
    names = set()
    for field in fields:
        if not isinstance(field, dict) or not isinstance(field.get("name"), str):
            raise PackError(f"{where}: a field without a name)")
        name, kind = field["name"], field.get("kind")
        if name in names:
            raise PackError(f"{where}: field {name[:60]!r} repeats)")
        names.add(name)
        if kind not in FIELD_KINDS:
            raise PackError(f"{where}: field {name[:60]!r} of unknown kind {str(kind)[:20]!r})")
        if kind == "array":
            _check_array_field(field, f"{where}: field {name[:60]!r}")
    return schema


def _check_array_field(field: dict, where: str) -> None:
    ndim = field.get("ndim")
    if not isinstance(ndim, int) or isinstance(ndim, bool) or not 0 <= ndim <= MAX_NDIM:
        raise PackError(f"{where} has a bad ndim)")
    try:
        dtype = np.dtype(str(field.get("dtype")))
    except TypeError:
        raise PackError(f"{where} has a bad dtype)") from None
    if dtype.kind not in "biufc" or dtype.hasobject:
        raise PackError(f"{where} has dtype {dtype})")


def encode_fields(values: list[Any]) -> bytes:
    """The payload (NOTE [ Fields payload ]) of already-encoded field values.

    Args:
        values: one ``bytes``-like per field, each already in its kind's layout (see
            ``encode_array``, ``encode_image``, ``encode_scalar``).
    """
    table = bytearray(_COUNT.pack(len(values)))
    end = 0
    for value in values:
        end += len(value)
        table += struct.pack("<Q", end)
    return bytes(table) + b"".join(values)


def encode_array(array: np.ndarray, dtype: np.dtype) -> bytes:
    """An ``array`` field's bytes: its dimensions, then its elements as ``dtype``."""
    array = np.asarray(array, dtype=dtype)  # not ascontiguousarray: it makes 0-d arrays 1-d
    return struct.pack(f"<{array.ndim}Q", *array.shape) + array.tobytes()  # C order, any strides


def encode_image(kind: int, shape: tuple[int, int, int] | None, data: bytes) -> bytes:
    """An ``image`` field's bytes: encoded file bytes (``IMAGE_ENCODED``) or raw HWC pixels."""
    height, width, channels = shape if kind == IMAGE_RAW else (0, 0, 0)
    return _IMAGE.pack(kind, height, width, channels) + bytes(data)


def encode_scalar(kind: str, value: Any) -> bytes:
    """An ``int``, ``float``, ``bool``, ``str``, ``bytes`` or ``json`` field's bytes."""
    if kind in _SCALARS:
        return _SCALARS[kind].pack(value)
    if kind == "str":
        return value.encode("utf-8", "surrogatepass")
    if kind == "json":
        return json.dumps(value, separators=(",", ":")).encode()
    return bytes(value)


def decode_fields(
    payload: memoryview,
    schema: dict[str, Any],
    where: str,
    image: Callable[[int, tuple[int, int, int] | None, memoryview, str], Any],
) -> Any:
    """The sample stored in a ``FIELDS`` payload, in the schema's structure.

    Args:
        payload: the record's payload (a view into the file: nothing returned refers to it
            except through ``image``, which must copy).
        schema: the checked schema.
        where: how errors name the record.
        image: ``image(kind, shape, data, name)`` turns an image field into the sample's value.

    Raises:
        PackError: naming ``where`` and the field, for a payload that does not fit the schema.
    """
    return FieldsDecoder(schema).decode(payload, where, image)


class FieldsDecoder:
    """Decodes the payloads of one schema; its per-field work is planned once (a reader keeps
    one: decoding a pose sample of four fields costs a few microseconds)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        fields = schema["fields"]
        self.names = [field["name"] for field in fields]
        self.count = len(fields)
        self.table = struct.Struct(f"<I{self.count}Q")
        self.structure = schema["structure"]
        self.decoders = [self._decoder(field) for field in fields]

    def decode(self, payload: memoryview, where: str, image: Callable) -> Any:
        """See ``decode_fields``."""
        table = self.table
        if len(payload) < table.size:
            raise PackError(f"{where}: corrupt record (its field table does not fit the schema)")
        count, *ends = table.unpack_from(payload)
        if count != self.count:
            raise PackError(f"{where}: corrupt record (its field table does not fit the schema)")
        values = []
        start = base = table.size
        limit = len(payload)
        for decoder, end in zip(self.decoders, ends, strict=True):
            end += base
            if end < start or end > limit:
                raise PackError(f"{where}: corrupt record (field offsets do not fit the payload)")
            values.append(decoder(payload[start:end], where, image))
            start = end
        if start != limit:
            raise PackError(f"{where}: corrupt record (field offsets do not fit the payload)")
        if self.structure == "dict":
            return dict(zip(self.names, values, strict=True))
        return tuple(values) if self.structure == "tuple" else values

    def _decoder(self, field: dict) -> Callable[[memoryview, str, Callable], Any]:
        kind, name = field["kind"], field["name"]
        if kind == "array":
            return _array_decoder(name, np.dtype(field["dtype"]), field["ndim"])
        if kind == "image":
            return lambda data, where, image: _decode_image(name, data, where, image)
        if kind in _SCALARS:
            scalar = _SCALARS[kind]

            def decode_scalar(data: memoryview, where: str, image: Callable) -> Any:
                if len(data) != scalar.size:
                    raise PackError(f"{where}: corrupt field {name!r} ({len(data)} bytes)")
                return scalar.unpack(data)[0]

            return decode_scalar
        if kind == "bytes":
            return lambda data, where, image: bytes(data)
        return lambda data, where, image: _decode_text(kind, name, data, where)


def _array_decoder(name: str, dtype: np.dtype, ndim: int) -> Callable:
    dims = struct.Struct(f"<{ndim}Q")
    native = dtype.newbyteorder("=")
    itemsize = dtype.itemsize

    def decode_array(data: memoryview, where: str, image: Callable) -> np.ndarray:
        if len(data) < dims.size:
            raise PackError(f"{where}: corrupt field {name!r} (no room for its shape)")
        shape = dims.unpack_from(data)
        items = 1
        for length in shape:
            items *= length
        if items * itemsize != len(data) - dims.size:
            raise PackError(f"{where}: corrupt field {name!r} (shape {shape} does not fit)")
        array = np.frombuffer(data, dtype, items, dims.size).reshape(shape)
        return array.astype(native) if native != dtype else array.copy()

    return decode_array


def _decode_image(name: str, data: memoryview, where: str, image: Callable) -> Any:
    if len(data) < _IMAGE.size:
        raise PackError(f"{where}: corrupt field {name!r} (no room for its image header)")
    stored, height, width, channels = _IMAGE.unpack_from(data)
    pixels = data[_IMAGE.size :]
    if stored == IMAGE_RAW:
        if height * width * channels != len(pixels) or channels not in (1, 3, 4):
            raise PackError(f"{where}: corrupt field {name!r} (pixels do not fit the shape)")
        return image(stored, (height, width, channels), pixels, name)
    if stored != IMAGE_ENCODED:
        raise PackError(f"{where}: corrupt field {name!r} (unknown image kind {stored})")
    return image(stored, None, pixels, name)


def _decode_text(kind: str, name: str, data: memoryview, where: str) -> Any:
    try:
        text = bytes(data).decode("utf-8", "surrogatepass" if kind == "str" else "strict")
    except UnicodeDecodeError:
        raise PackError(f"{where}: corrupt field {name!r} (not UTF-8)") from None
    if kind == "str":
        return text
    return parse_json(text, Path(where), f"field {name!r}")
