"""What every peer row shares: the samples as fields of an HDF5 file, and an epoch's checksum.

The peers (litdata, MosaicML MDS) are given the same samples as fastloader: the rows of an
HDF5 file of fixed-shape fields (written by the benchmark that owns the samples), each peer
building its own copy from that file. An epoch's checksum is the sum (mod 2**64) of one
BLAKE2b digest per sample over its fields' bytes in name order, so it does not depend on the
order the samples come in but does on every byte and on how often each sample comes: a peer
row is honest only when its checksum equals the file's.

Imports only the standard library, NumPy and h5py: MosaicML's side venv runs this module too.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

MASK = (1 << 64) - 1


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | np.bytes_):
        return bytes(value)
    if hasattr(value, "numpy"):  # a torch tensor
        value = value.numpy()
    array = np.ascontiguousarray(value)
    if array.dtype.kind in "iub" and array.ndim == 0:
        array = array.astype(np.int64)  # a label: int64 whoever collated it
    return array.tobytes()


def sample_digest(sample: dict) -> int:
    """One sample's digest: BLAKE2b-64 over its fields' bytes, fields in name order."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(sample):
        digest.update(name.encode())
        digest.update(_bytes(sample[name]))
    return int.from_bytes(digest.digest(), "little")


def _unbatch(batch: dict) -> Iterator[dict]:
    count = len(next(iter(batch.values())))
    for index in range(count):
        yield {name: values[index] for name, values in batch.items()}


def epoch_digest(batches: Iterable[dict], fields: tuple[str, ...]) -> tuple[int, str]:
    """(samples, checksum) of an epoch of collated batches, only ``fields`` counted."""
    total, count = 0, 0
    for batch in batches:
        for sample in _unbatch({name: batch[name] for name in fields}):
            total = (total + sample_digest(sample)) & MASK
            count += 1
    return count, f"{total:016x}"


def read_rows(path: Path, start: int, end: int) -> list[dict]:
    """Rows ``start:end`` of the HDF5 file as samples (names as str, scalars as Python ints)."""
    import h5py

    with h5py.File(path, "r") as file:
        columns = {name: file[name][start:end] for name in sorted(file)}
    samples = []
    for index in range(end - start):
        sample = {}
        for name, column in columns.items():
            value = column[index]
            if isinstance(value, bytes | np.bytes_):
                value = bytes(value).decode()
            elif np.ndim(value) == 0:
                value = value.item()
            sample[name] = value
        samples.append(sample)
    return samples


def file_digest(path: Path) -> tuple[int, str]:
    """(samples, checksum) of every row of the HDF5 file: what an honest epoch returns."""
    import h5py

    with h5py.File(path, "r") as file:
        fields = tuple(sorted(file))
        count = len(file[fields[0]])
    total = 0
    for start in range(0, count, 4096):
        for sample in read_rows(path, start, min(count, start + 4096)):
            total = (total + sample_digest(sample)) & MASK
    return count, f"{total:016x}"


def timed_epoch(loader: Any, key: str) -> tuple[int, float]:
    """(samples, seconds) of one epoch of ``loader``, counting ``key``'s entries per batch."""
    started = time.perf_counter()
    samples = 0
    for batch in loader:
        samples += len(batch[key])
    return samples, time.perf_counter() - started


class LoaderPeer:
    """A peer read through a DataLoader-like ``self.loader`` of batches keyed by
    ``self.fields``: ``epoch()``, ``digest()`` and ``close()``, as the peers' rows ask."""

    loader: Any
    fields: tuple[str, ...]

    def epoch(self) -> tuple[int, float]:
        """(samples, seconds) of one epoch."""
        return timed_epoch(self.loader, self.fields[0])

    def digest(self) -> tuple[int, str]:
        """(samples, checksum) of one epoch."""
        return epoch_digest(self.loader, self.fields)

    def close(self) -> None:
        """Ends the loader's workers."""
        from benchmarks.formats import close_loader

        close_loader(self.loader)
