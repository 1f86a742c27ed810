"""HDF5 packs: every record back to back in one uint8 dataset, located by an offsets array.

Datasets: ``records`` (uint8, contiguous), ``offsets`` (int64, count + 1), ``targets`` (int64);
the JSON metadata is the file attribute ``fastloader``, written last, so a file without it is an
interrupted run (see records.load_metadata).

NOTE [ Contiguous HDF5 records ]
A random read of a chunked dataset goes through HDF5's chunk index and cache and copies whole
chunks; on a pack of a few hundred MB that halved read throughput. So ``records`` is one
contiguous block: the writer spools records to an anonymous temporary file and writes the block
once, at close, when its size is known. Readers then memory-map the block at the offset HDF5
reports and read records as zero-copy slices, as LMDB readers do.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

import h5py
import numpy as np

from fastloader.formats.base import PackedDataset, PackWriter
from fastloader.formats.records import (
    PackError,
    check_targets,
    load_metadata,
)

_METADATA_ATTR = "fastloader"
_COPY_BYTES = 64 << 20


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

    def _open(self) -> _Handle:
        try:
            file = h5py.File(self.path, "r")
        except OSError as error:
            raise PackError(f"{self.path}: not a readable HDF5 file ({error})") from None
        return _Handle(file, self.path)

    def _close_handle(self, handle: _Handle) -> None:
        handle.close()

    def _load_index(self, handle: _Handle) -> tuple[dict, np.ndarray]:
        raw = handle.file.attrs.get(_METADATA_ATTR)
        metadata = load_metadata(raw, self.path, self.backend)
        try:
            targets = handle.file["targets"][()].astype(np.int64)
            offsets = handle.file["offsets"][()].astype(np.int64)
            stored = handle.file["records"].shape[0]
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

    def _read_each(self, handle: _Handle, indices: Sequence[int], use: Callable) -> list:
        records = handle.records()
        offsets = self._offsets
        samples = []
        for index in indices:
            try:
                buffer = records[offsets[index] : offsets[index + 1]]
            except OSError as error:  # a damaged chunk (only when not memory-mapped)
                raise PackError(f"{self.path}: record {index} cannot be read ({error})") from None
            samples.append(use(index, buffer))
        return samples


class _Handle:
    """An open pack: the HDF5 file, and its records block memory-mapped when contiguous."""

    def __init__(self, file: h5py.File, path: Path) -> None:
        self.file = file
        self._mapped: np.ndarray | None = None
        records = file.get("records")
        offset = records.id.get_offset() if isinstance(records, h5py.Dataset) else None
        if offset is None or records.dtype != np.uint8 or records.ndim != 1:
            return  # empty, chunked or foreign: read through h5py (see _load_index's checks)
        end = offset + records.shape[0]
        if os.path.getsize(path) < end:  # mapping past the end would crash with SIGBUS
            file.close()
            raise PackError(f"{path}: truncated HDF5 file ({os.path.getsize(path)} of {end} bytes)")
        self._mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=records.shape)

    def records(self) -> np.ndarray | h5py.Dataset:
        return self._mapped if self._mapped is not None else self.file["records"]

    def close(self) -> None:
        self._mapped = None
        self.file.close()


class HDF5Writer(PackWriter):
    """Writes an HDF5 pack to exactly ``path``; the file is complete only after ``close()``.

    Arguments and errors as ``PackWriter``.
    """

    backend = "hdf5"

    def _open(self) -> None:
        self._file = h5py.File(self.path, "x")  # "x" raises FileExistsError
        # Records are spooled here until close(): see NOTE [ Contiguous HDF5 records ].
        self._spool = tempfile.TemporaryFile(dir=self.path.parent, prefix=f".{self.path.name}.")
        self._offsets = array("q", [0])
        self._labels = array("q")

    def append(self, record: bytes, label: int) -> None:
        self._spool.write(record)
        self.bytes_written += len(record)
        self._offsets.append(self.bytes_written)
        self._labels.append(int(label))
        self.count += 1

    def close(self) -> None:
        """Write the records block, offsets, labels and metadata, then close: now complete."""
        records = self._file.create_dataset("records", shape=(self.bytes_written,), dtype=np.uint8)
        self._spool.seek(0)
        start = 0
        while block := self._spool.read(_COPY_BYTES):
            records[start : start + len(block)] = np.frombuffer(block, dtype=np.uint8)
            start += len(block)
        self._spool.close()
        self._file.create_dataset("offsets", data=np.frombuffer(self._offsets, dtype=np.int64))
        self._file.create_dataset("targets", data=np.frombuffer(self._labels, dtype=np.int64))
        self._file.attrs[_METADATA_ATTR] = self.metadata_json().decode()
        self._file.close()

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        self._spool.close()
        self._file.close()
