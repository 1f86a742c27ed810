"""Torch datasets over users' own files: ``HDF5FileDataset`` and ``LMDBFileDataset``.

Runs in whichever process reads. The reading core is torch-free (``formats.hdf5_foreign``,
``formats.lmdb_foreign``); this adds what a torch ``Dataset`` offers: ``transform`` on the whole
sample, per-sample seeding of a batch read (``getitems_with``), and tuples when asked for.
``fastloader.HDF5Dataset(path)`` and ``fastloader.LMDBDataset(path)`` return these for a file
that is not a fastloader pack (see ``open_foreign``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset

from fastloader.datasets.columns import ColumnBatch
from fastloader.formats.hdf5_foreign import HDF5File
from fastloader.formats.lmdb_foreign import LMDBFile

__all__ = ["HDF5FileDataset", "LMDBFileDataset"]


class _SampleTransforms:
    """``transform`` applied to each sample, with seeding hooks for a batch read."""

    transform: Callable | None

    def __getitem__(self, index: int) -> Any:
        return self.getitems_with([index], None)[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        return self.getitems_with(indices, None)

    def getitems_with(
        self, indices: Sequence[int], before_each: Callable[[int], None] | None
    ) -> list:
        """The samples ``indices``, read in one batch, ``before_each(index)`` called before each
        sample is shaped and transformed (fastloader.DataLoader seeds its RNGs there)."""
        samples = self.read_many(indices)
        if self.transform is None:  # no code of the user's runs: nothing to seed
            return [self._shape(sample) for sample in samples]
        out = []
        for index, sample in zip(indices, samples, strict=True):
            if before_each is not None:
                before_each(index)
            sample = self._shape(sample)
            out.append(sample if self.transform is None else self.transform(sample))
        return out

    def _shape(self, sample: Any) -> Any:
        return sample


class HDF5FileDataset(_SampleTransforms, HDF5File, Dataset):
    """A map-style dataset over a user's HDF5 file of aligned datasets, read in place.

    ``dataset[i]`` is ``{name: row i}`` for every field: NumPy arrays for rows of more than one
    value, Python numbers for datasets of shape ``(N,)``, ``str`` for string datasets. The file
    is opened lazily in each process that reads (fork, spawn and forkserver workers alike);
    contiguous datasets are read through fastloader's own map, chunked or compressed ones with
    one h5py read per field per batch. See docs/any-sample.md.

    Args:
        path: the HDF5 file.
        fields: the datasets to read, by path (``"labels/boxes"``); default every top-level
            dataset. All must have the same first dimension.
        transform: applied to each sample (the dict, or the tuple with ``as_tuple``).
        as_tuple: return a tuple in ``fields`` order instead of a dict.
        allow_external: read datasets stored in other files (external links, external storage,
            virtual datasets); refused by default.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: naming the file and the dataset, for an unreadable file, a missing, 0-d,
            misaligned, external (without ``allow_external``), damaged or unreadable-dtype
            dataset; when reading, naming the sample or the chunk's rows, for a chunk whose
            index entry does not fit its layout or a string that is not of its declared
            character set, and if the file changed since (NOTE [ A file changed under a
            reader ] in formats/hdf5_foreign.py).
        ValueError: for ``as_tuple`` without ``fields``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fields: Sequence[str] | None = None,
        *,
        transform: Callable | None = None,
        as_tuple: bool = False,
        allow_external: bool = False,
    ) -> None:
        if as_tuple and fields is None:
            raise ValueError("as_tuple=True needs fields= (the order of the tuple)")
        HDF5File.__init__(self, path, fields, allow_external=allow_external)
        self.transform = transform
        self.as_tuple = as_tuple

    def _shape(self, sample: dict) -> Any:
        return tuple(sample[name] for name in self.field_names) if self.as_tuple else sample

    def getitems_with(
        self, indices: Sequence[int], before_each: Callable[[int], None] | None
    ) -> list:
        if self.transform is None and not self.as_tuple:  # the dicts as read: the fast path
            return self.read_many(indices)
        return super().getitems_with(indices, before_each)

    def read_batch_columns(self, indices: Sequence[int]) -> ColumnBatch | None:
        """The samples ``indices`` as one ``ColumnBatch`` for the loader's default collate
        (NOTE [ Batches read by columns ]); None when samples are transformed or tuples,
        ``indices`` is empty, or a subclass reads samples its own way. Raises as
        ``read_many``."""
        if self.transform is not None or self.as_tuple or not len(indices):
            return None
        kind = type(self)
        if kind is not HDF5FileDataset and any(  # a subclass's samples: its own methods
            getattr(kind, name) is not getattr(HDF5FileDataset, name) for name in _READS
        ):
            return None
        return ColumnBatch(self.read_columns(indices, later=True), len(indices))


#: What makes an ``HDF5FileDataset``'s samples: a subclass that overrides any of them does not
#: get its batches read by columns.
_READS = ("getitems_with", "read_many", "read_columns", "_shape", "__getitems__", "__getitem__")


class LMDBFileDataset(_SampleTransforms, LMDBFile, Dataset):
    """A map-style dataset over a user's LMDB environment: sample ``i`` is the ``i``-th value.

    Values come back as ``bytes``, or through ``decode``; fastloader never unpickles them.
    The whole tree is checked when the dataset is created; named sub-databases are not samples
    (NOTE [ Users' LMDB trees checked whole ] in formats/lmdb_tree.py).

    Args:
        path: the environment (a folder with ``data.mdb``, or one LMDB file).
        keys: the keys to read, in sample order; default every key, in key order.
        decode: turns a value's bytes into a sample (``json.loads``, an image decoder...).
        transform: applied to each decoded sample.

    Raises:
        FileNotFoundError, PackError, KeyError, TypeError: as ``LMDBFile`` (the torch-free
            reader, formats/lmdb_foreign.py) for ``path``, the environment and ``keys``;
            PackError also when reading, naming the environment, if it changed since.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Sequence[bytes | str] | None = None,
        decode: Callable[[bytes], Any] | None = None,
        *,
        transform: Callable | None = None,
    ) -> None:
        LMDBFile.__init__(self, path, keys, decode)
        self.transform = transform

    def getitems_with(
        self, indices: Sequence[int], before_each: Callable[[int], None] | None
    ) -> list:
        if self.decode is None:
            return super().getitems_with(indices, before_each)
        # decode is the user's code, as transform is: run per sample, after before_each (the
        # loader seeds each sample there: NOTE [ Seeding contract ])
        out = []
        for index, value in zip(indices, self.read_many(indices, raw=True), strict=True):
            if before_each is not None:
                before_each(index)
            sample = self.decode(value)
            out.append(sample if self.transform is None else self.transform(sample))
        return out
