"""HDF5 packs: every record back to back in one uint8 dataset, located by an offsets array.

Datasets: ``records`` (uint8, chunked), ``offsets`` (int64, count + 1), ``targets`` (int64);
the JSON metadata is the file attribute ``fastloader``, written last, so a file without it is an
interrupted run (see records.load_metadata).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fastloader.formats.base import PackedDataset
from fastloader.formats.records import (
    PackError,
    check_targets,
    dump_metadata,
    load_metadata,
    make_metadata,
)

_METADATA_ATTR = "fastloader"
_CHUNK_BYTES = 64 << 10  # small: a random read decompresses nothing but copies whole chunks
_FLUSH_BYTES = 16 << 20
_CACHE_BYTES = 4 << 20


class HDF5Dataset(PackedDataset):
    """An ImageFolder-like dataset over a pack written by ``fastloader-pack`` in HDF5 format.

    Args:
        path: the ``.h5``/``.hdf5`` file.
        transform: applied to each image (as torchvision transforms are).
        target_transform: applied to each label.
        decode: "pil" (RGB image, default), "tensor" (uint8 CHW), "numpy" (uint8 HWC), or
            "bytes" (the stored payload).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is truncated, not a fastloader HDF5 pack, unfinished, or from a newer
            fastloader.
        ValueError: for an unknown ``decode``.
    """

    backend = "hdf5"

    def _open(self) -> h5py.File:
        try:
            return h5py.File(self.path, "r", rdcc_nbytes=_CACHE_BYTES)
        except OSError as error:
            raise PackError(f"{self.path}: not a readable HDF5 file ({error})") from None

    def _load_index(self, handle: h5py.File) -> tuple[dict, np.ndarray]:
        raw = handle.attrs.get(_METADATA_ATTR)
        metadata = load_metadata(raw, self.path, self.backend)
        try:
            targets = handle["targets"][()].astype(np.int64)
            offsets = handle["offsets"][()].astype(np.int64)
            stored = handle["records"].shape[0]
        except (KeyError, OSError, TypeError, AttributeError) as error:
            raise PackError(f"{self.path}: corrupt pack ({error})") from None
        if (
            len(offsets) != metadata["count"] + 1
            or offsets[0] != 0
            or offsets[-1] != stored
            or np.any(np.diff(offsets) < 0)
        ):
            raise PackError(f"{self.path}: corrupt pack (record offsets do not fit the data)")
        self._offsets = offsets
        return metadata, check_targets(targets, metadata, self.path)

    def _read_each(self, handle: h5py.File, indices: Sequence[int], use: Callable) -> list:
        records = handle["records"]
        offsets = self._offsets
        samples = []
        for index in indices:
            try:
                buffer = records[offsets[index] : offsets[index + 1]]
            except OSError as error:  # a damaged chunk
                raise PackError(f"{self.path}: record {index} cannot be read ({error})") from None
            samples.append(use(index, buffer))
        return samples


class HDF5Writer:
    """Writes an HDF5 pack to exactly ``path``; the file is complete only after ``close()``.

    Args:
        path: the file to write (must not exist).
        store: the store mode recorded in the metadata ("encoded", "raw" or "jpeg").
        classes: class names, indexed by label.
        info: extra JSON-able facts to keep in the metadata (source, options, ...). The
            ``store``, ``classes`` and ``info`` attributes are read when ``close()`` writes the
            metadata.

    Raises:
        FileExistsError: if ``path`` exists.
    """

    backend = "hdf5"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        store: str,
        classes: Sequence[str],
        info: dict | None = None,
    ) -> None:
        self.path = Path(path)
        # Read by close(), so a caller can still add what it learns while writing.
        self.store = store
        self.classes = list(classes)
        self.info = dict(info or {})
        dump_metadata(make_metadata(self.backend, store, 0, classes, info))  # fail early
        self._file = h5py.File(self.path, "x")  # "x" raises FileExistsError
        self._records = self._file.create_dataset(
            "records", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(_CHUNK_BYTES,)
        )
        self._buffer = bytearray()
        self._offsets = array("q", [0])
        self._labels = array("q")
        self.count = 0
        self.bytes_written = 0

    def append(self, record: bytes, label: int) -> None:
        """Add the next record (index ``count``) with its label."""
        self._buffer += record
        self.bytes_written += len(record)
        self._offsets.append(self.bytes_written)
        self._labels.append(int(label))
        self.count += 1
        if len(self._buffer) >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        start = self._records.shape[0]
        self._records.resize((start + len(self._buffer),))
        self._records[start:] = np.frombuffer(self._buffer, dtype=np.uint8)
        self._buffer = bytearray()

    def close(self) -> None:
        """Write the offsets, labels and metadata, then close: the pack is then complete."""
        self._flush()
        self._file.create_dataset("offsets", data=np.frombuffer(self._offsets, dtype=np.int64))
        self._file.create_dataset("targets", data=np.frombuffer(self._labels, dtype=np.int64))
        metadata = make_metadata(self.backend, self.store, self.count, self.classes, self.info)
        self._file.attrs[_METADATA_ATTR] = dump_metadata(metadata).decode()
        self._file.close()

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        self._file.close()

    def __enter__(self) -> HDF5Writer:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
