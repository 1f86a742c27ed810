"""Packed storage: one record codec and metadata schema, an LMDB and an HDF5 backend.

Also users' own HDF5 files and LMDB environments read in place, their structure checks, read
advice and verification. Torch-free (NOTE [ Torch-free pack files ]).

May import: the standard library, NumPy, h5py, lmdb, xxhash; nothing else of fastloader.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastloader.formats.column_layout import LAYOUTS
from fastloader.formats.lmdb import LMDBPack, LMDBWriter
from fastloader.formats.pack_writer import PackWriter
from fastloader.formats.packfile import PackFile, check_file
from fastloader.formats.records import (
    FORMAT_VERSION,
    STORE_MODES,
    PackError,
    Record,
    RecordKind,
    decode_record,
    encode_record,
)
from fastloader.formats.signatures import file_kind

if TYPE_CHECKING:  # for type checkers and IDEs: the lazy names below, imported eagerly
    from fastloader.formats.hdf5 import HDF5Pack, HDF5Writer

# NOTE [ Torch-free pack files ]
# `fastloader-pack --info`, `--verify` and packing an image folder must not import torch
# (seconds on a loaded machine; see NOTE [ Fast command start-up ] in cli.py). So this package
# is the torch-free storage core: the backends' readers (LMDBPack, HDF5Pack, on
# formats.packfile.PackFile) open and check the file, its metadata, labels, records and source
# paths with NumPy, lmdb and h5py only, and nothing in it imports from the rest of fastloader.
# The torch datasets (fastloader/datasets/packs.py: LMDBDataset = LMDBPack + PackedDataset) add
# decoding and transforms on top. h5py waits for an HDF5 pack (PEP 562, as
# fastloader/__init__.py does). Pack workers test for tensors without importing torch
# (packfile.is_tensor). tests/test_cli.py checks that packing a folder, `--info` and `--verify`
# leave torch out of sys.modules; tests/test_layout.py that this package imports no torch.
_LAZY = {"HDF5Pack": "fastloader.formats.hdf5", "HDF5Writer": "fastloader.formats.hdf5"}

#: The pack formats, by the name ``format=`` and ``--format`` take.
FORMATS = ("lmdb", "hdf5")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fastloader.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FORMAT_VERSION",
    "FORMATS",
    "LAYOUTS",
    "STORE_MODES",
    "HDF5Pack",
    "HDF5Writer",
    "LMDBPack",
    "LMDBWriter",
    "PackError",
    "PackFile",
    "PackWriter",
    "Record",
    "RecordKind",
    "decode_record",
    "encode_record",
    "format_from_suffix",
    "open_pack_file",
    "open_writer",
    "read_metadata",
    "sniff_format",
]

#: Each format's module and its reader and writer classes (h5py is imported only when needed).
_BACKENDS = {
    "lmdb": ("fastloader.formats.lmdb", "LMDBPack", "LMDBWriter"),
    "hdf5": ("fastloader.formats.hdf5", "HDF5Pack", "HDF5Writer"),
}

#: Each format's writer of packs laid out by columns (NOTE [ Packs laid out by columns ]).
_COLUMN_WRITERS = {
    "lmdb": ("fastloader.formats.lmdb_columns", "LMDBColumnWriter"),
    "hdf5": ("fastloader.formats.hdf5", "HDF5ColumnWriter"),
}


def _backend(format: str, role: str) -> Any:
    """The reader (``role="reader"``) or writer class of backend ``format``."""
    module, reader, writer = _BACKENDS[format]
    return getattr(importlib.import_module(module), reader if role == "reader" else writer)


_SUFFIXES = {".lmdb": "lmdb", ".h5": "hdf5", ".hdf5": "hdf5"}


def format_from_suffix(path: str | os.PathLike) -> str:
    """Return "lmdb" for a ``.lmdb`` path, "hdf5" for ``.h5``/``.hdf5``.

    Raises:
        ValueError: naming the path for any other suffix.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"{path}: cannot tell the format from the suffix {suffix!r}: use .lmdb, .h5 or "
            f".hdf5, or name the format"
        )
    return _SUFFIXES[suffix]


def open_writer(
    path: str | os.PathLike,
    format: str,
    *,
    store: str,
    classes: Sequence[str],
    info: dict | None = None,
    layout: str = "records",
) -> LMDBWriter | HDF5Writer:
    """Return a writer of ``format`` ("lmdb" or "hdf5") for exactly ``path``.

    ``layout="columns"`` writes a pack of fields by columns (format 5: NOTE [ Packs laid out by
    columns ] in column_layout.py); its ``schema`` must be set before the first append.

    Raises:
        ValueError: for an unknown format, store mode or layout.
        FileExistsError: if ``path`` exists.
    """
    if format not in _BACKENDS:
        raise ValueError(f"format must be one of {tuple(_BACKENDS)}, got {format!r}")
    if store not in STORE_MODES:
        raise ValueError(f"store must be one of {STORE_MODES}, got {store!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "columns":
        module, name = _COLUMN_WRITERS[format]
        cls = getattr(importlib.import_module(module), name)
    else:
        cls = _backend(format, "writer")
    return cls(path, store=store, classes=classes, info=info)


def open_pack_file(path: str | os.PathLike, *, verify_checksums: bool = True) -> PackFile:
    """Open a pack of either format as a torch-free reader (metadata, labels, raw records).

    Checks what ``open_pack`` checks; reads records undecoded (``read_record``).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is not a complete, readable fastloader pack.
    """
    path = Path(path)
    check_file(path)
    return _backend(sniff_format(path), "reader")(path, verify_checksums=verify_checksums)


def sniff_format(path: Path) -> str:
    """Return "hdf5" or "lmdb" from the first bytes of the file at ``path``.

    Raises:
        PackError: naming the file, when it starts as neither (saying which its name suggests).
    """
    kind = file_kind(path)
    if kind is not None:
        return kind
    expected = _SUFFIXES.get(path.suffix.lower())
    named = {"hdf5": "an HDF5 file", "lmdb": "an LMDB file"}
    hint = (
        f"named as {named[expected]} but it does not start like one: the start of the file "
        f"is damaged, or it is another kind of file"
        if expected
        else "it starts as neither an HDF5 nor an LMDB file"
    )
    raise PackError(f"{path}: not a fastloader pack ({hint})")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Return the checked metadata of the pack at ``path`` (see ``open_pack`` for errors).

    The result also says whether the pack records each sample's source path
    (``"sources"``: True, read one by one with ``dataset.source_path(i)``), and has the file's
    ``"size_bytes"``.
    """
    dataset = open_pack_file(path)
    try:
        metadata = dict(dataset.metadata)
        metadata["size_bytes"] = os.path.getsize(dataset.path)
        if metadata["sources"] and len(dataset):
            metadata["first_source"] = dataset.source_path(0)
        return metadata
    finally:
        dataset.close()
