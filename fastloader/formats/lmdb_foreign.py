"""Users' own LMDB environments, read in place: the i-th value in key order is sample i.

``LMDBFile(path)`` reads an environment fastloader did not write (a folder with ``data.mdb``,
as ``lmdb.open`` makes by default, or a single file). Values come back as ``bytes``, or as what
the user's ``decode`` callable makes of them: fastloader never unpickles on its own. Torch-free;
the torch dataset is ``fastloader.datasets.users_files.LMDBFileDataset``.

NOTE [ Foreign LMDB environments ]
As for HDF5 (NOTE [ Foreign HDF5 files ] in hdf5_foreign.py), a user's environment carries no
checksum, but a damaged one must not crash the reader nor give a sample LMDB would not: its
meta pages are checked against the file, then its whole main-database tree is walked and
checked in fastloader's own read-only map (NOTE [ Users' LMDB trees checked whole ] in
lmdb_tree.py), once, at construction. The walk lists every key and where its value lies, into
NumPy arrays (no Python list of keys: "No copy-on-write growth" in the design); a read is then
a slice of the same map, in the process that reads: neither LMDB nor py-lmdb ever walks a
user's tree. Before each batch the file's identity (device, inode, size, modification time) is
compared with the one checked: an environment written, truncated or replaced since is an
error naming it, not a read of pages that moved (or a SIGBUS past a truncated end).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.lmdb_checks import (
    check_lmdb_file,
    checked_meta,
    record_key,
    value_lies_in_file,
)
from fastloader.formats.lmdb_tree import check_tree
from fastloader.formats.packfile import ForkSafeFile, file_identity, sample_row
from fastloader.formats.records import PackError

__all__ = ["LMDBFile", "is_lmdb_pack"]

_PACK_KEYS = (b"__metadata__", b"__targets__", b"__sources__", b"__source_offsets__")


def _data_file(path: Path) -> tuple[Path, bool]:
    """The file holding the data, and whether ``path`` is an environment folder."""
    if path.is_dir():
        return path / "data.mdb", True
    return path, False


def is_lmdb_pack(path: str | os.PathLike) -> bool:
    """Whether ``path`` should be opened as a fastloader pack rather than a user's environment.

    A folder is a user's environment (packs are single files). A file is a pack if it holds a
    key only packs have (the metadata, the labels, or record 0 under its 8-byte index: an
    interrupted pack has only records), found by fastloader's own checked walk of the B-tree
    (lmdb_checks), never by py-lmdb on a file not yet trusted; a file that is not LMDB, or is
    damaged, is left to the pack reader, which says what is wrong.
    """
    path = Path(path)
    if path.is_dir():
        return False
    try:
        size = os.path.getsize(path)
        psize, root = check_lmdb_file(path, size)
        if root == (1 << 64) - 1:  # an empty database
            return True
        with (
            open(path, "rb") as opened,
            mmap.mmap(opened.fileno(), size, access=mmap.ACCESS_READ) as mapped,
        ):
            return any(
                value_lies_in_file(mapped, psize, root, key) is not None
                for key in (*_PACK_KEYS[:2], record_key(0))
            )
    except Exception:  # noqa: BLE001 - the pack reader reports what is wrong
        return True


class _Handle:
    """fastloader's read-only map of the data file, in one process."""

    def __init__(self, data: Path, size: int) -> None:
        with open(data, "rb") as opened:
            self.map = mmap.mmap(opened.fileno(), size, access=mmap.ACCESS_READ)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view still alive: unmapped when the last one goes
            pass


class LMDBFile(ForkSafeFile):
    """A user's LMDB environment: sample ``i`` is the value of the ``i``-th key (torch-free).

    Named sub-databases are not samples: their entries in the main database are skipped, and
    naming one in ``keys`` is refused (NOTE [ Users' LMDB trees checked whole ]).

    Args:
        path: the environment: a folder holding ``data.mdb``, or a single LMDB file.
        keys: the keys to read, in sample order (bytes, or str encoded as UTF-8); default every
            key of the main database, in LMDB's (byte-wise sorted) order.
        decode: a callable turning a value's bytes into the sample; default the bytes.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: naming the environment if it is damaged, truncated or not LMDB, or its main
            database has flags (dupsort, integer keys) whose order is not byte order.
        KeyError: if a key of ``keys`` is not in it, or names a sub-database.
        TypeError: if a key of ``keys`` is neither bytes nor str.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Sequence[bytes | str] | None = None,
        decode: Callable[[bytes], Any] | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such LMDB environment")
        self._data, self._subdir = _data_file(self.path)
        if not self._data.is_file():
            raise PackError(f"{self.path}: a folder without data.mdb, not an LMDB environment")
        wanted = None if keys is None else _as_keys(keys)
        self.decode = decode
        self._identity = file_identity(self._data)
        self._handle: _Handle | None = None
        self._pid: int | None = None
        size = self._identity[2]
        meta = checked_meta(self._data, size, whole=False)  # before anything maps more
        handle = self._handle_here()
        try:
            tree = check_tree(handle.map, self.path, meta)
        finally:
            self.close()
        if wanted is None:
            self._keys, self._key_offsets = tree.keys, tree.key_offsets
            self._starts, self._sizes = tree.starts, tree.sizes
        else:
            self._select(tree, wanted)

    def _select(self, tree: Any, wanted: list[bytes]) -> None:
        """Keep the keys ``wanted``, in their order (KeyError for one not in the tree)."""
        listed = tree.keys.tobytes()
        offsets = tree.key_offsets.tolist()
        row = {listed[offsets[i] : offsets[i + 1]]: i for i in range(len(offsets) - 1)}
        subdatabases = [key for key in wanted if key in tree.subdatabases]
        if subdatabases:
            raise KeyError(
                f"{self.path}: the keys {subdatabases[:5]} name sub-databases, not samples "
                f"(only the main database's values are read)"
            )
        missing = [key for key in wanted if key not in row]
        if missing:
            raise KeyError(f"{self.path}: no value under the keys {missing[:5]}")
        rows = np.array([row[key] for key in wanted], dtype=np.int64)
        self._keys = np.frombuffer(b"".join(wanted), dtype=np.uint8)
        self._key_offsets = np.zeros(len(wanted) + 1, dtype=np.int64)
        np.cumsum([len(key) for key in wanted], out=self._key_offsets[1:])
        self._starts, self._sizes = tree.starts[rows], tree.sizes[rows]

    def __len__(self) -> int:
        return len(self._key_offsets) - 1

    def key(self, index: int) -> bytes:
        """The key of sample ``index``."""
        row = self._row(index)
        return self._keys[self._key_offsets[row] : self._key_offsets[row + 1]].tobytes()

    def __getitem__(self, index: int) -> Any:
        return self.read_many([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        return self.read_many(indices)

    def read_many(self, indices: Sequence[int], raw: bool = False) -> list[Any]:
        """Samples ``indices`` in order, their bytes with ``raw``.

        See NOTE [ Foreign LMDB environments ].

        Raises:
            IndexError: for an index out of range.
            PackError: if the environment changed since the dataset was created.
        """
        rows = [self._row(index) for index in indices]
        handle = self._handle_here()
        self._check_unchanged()  # every batch: NOTE [ Foreign LMDB environments ]
        view = handle.map
        starts, sizes = self._starts, self._sizes
        values = [view[starts[row] : starts[row] + sizes[row]] for row in rows]
        if self.decode is None or raw:
            return values
        return [self.decode(value) for value in values]

    def _row(self, index: int) -> int:
        return sample_row(index, len(self), self.path)

    def _check_unchanged(self) -> None:
        # NOTE [ Fork-safe readers ] in packfile.py
        try:
            identity = file_identity(self._data)
        except OSError:
            identity = None
        if identity != self._identity:
            raise PackError(
                f"{self.path}: the environment changed since this dataset opened it (written, "
                f"truncated or replaced): create the dataset again"
            )

    def _open(self) -> _Handle:
        return _Handle(self._data, self._identity[2])

    def _close_handle(self, handle: _Handle) -> None:
        handle.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self)} values)"


def _as_keys(keys: Sequence[bytes | str]) -> list[bytes]:
    if isinstance(keys, (str, bytes)):
        keys = [keys]
    out = []
    for at, key in enumerate(keys):
        if isinstance(key, str):
            out.append(key.encode())
        elif isinstance(key, (bytes, bytearray, memoryview)):
            out.append(bytes(key))
        else:
            raise TypeError(
                f"keys must be bytes or str, got {type(key).__name__} {key!r} at position {at}"
            )
    return out
