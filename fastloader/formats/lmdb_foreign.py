"""Users' own LMDB environments, read in place: the i-th value in key order is sample i.

``LMDBFile(path)`` reads an environment fastloader did not write (a folder with ``data.mdb``,
as ``lmdb.open`` makes by default, or a single file). Values come back as ``bytes``, or as what
the user's ``decode`` callable makes of them: fastloader never unpickles on its own. Torch-free;
the torch dataset is ``fastloader.datasets.users_files.LMDBFileDataset``.

NOTE [ Foreign LMDB environments ]
As for HDF5 (NOTE [ Foreign HDF5 files ] in hdf5_foreign.py), a user's environment carries no
checksum, but a damaged one must not crash the reader: its meta pages are checked against the
file before py-lmdb opens it, the map is no larger than the file, and each value's path through
the B-tree is walked in our own map and checked to lie in the file before py-lmdb is asked for
it (NOTE [ LMDB values checked against the file ] in lmdb.py, the same code). The keys are
listed once, at construction, into one byte string and an offsets array (no Python list of
keys: "No copy-on-write growth" in the design).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from fastloader.formats.lmdb_checks import check_lmdb_file, record_key, value_lies_in_file
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
        entry = _shared._open.get(file_identity(path))
        if entry is not None and entry[0] == os.getpid():
            return False  # open here already as a user's environment
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


class _opened:
    """A read-only environment as large as its file (NOTE [ Foreign LMDB environments ])."""

    def __init__(self, path: Path, size: int, *, subdir: bool) -> None:
        self.env = lmdb.open(
            str(path),
            subdir=subdir,
            readonly=True,
            lock=False,
            readahead=False,
            max_readers=2048,
            map_size=max(size, 1),
        )

    def __enter__(self) -> lmdb.Environment:
        return self.env

    def __exit__(self, *exc: Any) -> None:
        self.env.close()


class _Shared:
    """Environments shared by the readers of one process (py-lmdb opens a file once per
    process), counted by users; an entry inherited through a fork is closed in the child,
    unmapping only the child's copy (as lmdb._Environments does for packs)."""

    def __init__(self) -> None:
        self._open: dict[tuple, tuple[int, _Handle, int]] = {}

    def acquire(self, path: Path, data: Path, subdir: bool, identity: tuple) -> _Handle:
        pid = os.getpid()
        entry = self._open.get(identity)
        if entry is not None and entry[0] == pid:
            self._open[identity] = (pid, entry[1], entry[2] + 1)
            return entry[1]
        if entry is not None:
            try:
                entry[1].close()
            except Exception:  # noqa: BLE001
                pass
        handle = _Handle(path, data, subdir, identity[2])
        self._open[identity] = (pid, handle, 1)
        return handle

    def release(self, identity: tuple, handle: _Handle) -> None:
        entry = self._open.get(identity)
        if entry is None or entry[0] != os.getpid() or entry[1] is not handle:
            return
        if entry[2] > 1:
            self._open[identity] = (entry[0], handle, entry[2] - 1)
        else:
            del self._open[identity]
            handle.close()


class _Handle:
    def __init__(self, path: Path, data: Path, subdir: bool, size: int) -> None:
        self.psize, self.root = check_lmdb_file(data, size)
        try:
            self.env = _opened(path, size, subdir=subdir).env
        except lmdb.Error as error:
            raise PackError(f"{path}: not a readable LMDB environment ({error})") from None
        with open(data, "rb") as opened:
            self.map = mmap.mmap(opened.fileno(), size, access=mmap.ACCESS_READ)

    def close(self) -> None:
        self.env.close()
        self.map.close()


_shared = _Shared()


class LMDBFile(ForkSafeFile):
    """A user's LMDB environment: sample ``i`` is the value of the ``i``-th key (torch-free).

    Args:
        path: the environment: a folder holding ``data.mdb``, or a single LMDB file.
        keys: the keys to read, in sample order (bytes, or str encoded as UTF-8); default every
            key of the main database, in LMDB's (byte-wise sorted) order.
        decode: a callable turning a value's bytes into the sample; default the bytes.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: naming the environment if it is damaged, truncated or not LMDB.
        KeyError: if a key of ``keys`` is not in it.
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
        self.decode = decode
        self._identity = file_identity(self._data)
        self._handle: _Handle | None = None
        self._pid: int | None = None
        handle = self._handle_here()
        try:
            with handle.env.begin() as txn:
                if keys is None:
                    listed = list(txn.cursor().iternext(keys=True, values=False))
                else:
                    listed = [key.encode() if isinstance(key, str) else bytes(key) for key in keys]
                    missing = [key for key in listed if txn.get(key) is None]
                    if missing:
                        raise KeyError(f"{self.path}: no value under the keys {missing[:5]}")
        except lmdb.Error as error:
            raise PackError(f"{self.path}: damaged LMDB environment ({error})") from None
        finally:
            self.close()
        self._keys = np.frombuffer(b"".join(listed), dtype=np.uint8)
        self._key_offsets = np.cumsum([0] + [len(key) for key in listed], dtype=np.int64)

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

    def read_many(self, indices: Sequence[int]) -> list[Any]:
        """Samples ``indices`` in order, in one read transaction.

        Raises:
            IndexError: for an index out of range.
            PackError: if a value lies outside the file or the environment is damaged.
        """
        keys = [self.key(index) for index in indices]
        handle = self._handle_here()
        values = []
        try:
            with handle.env.begin(buffers=True) as txn:
                for key in keys:
                    inside = value_lies_in_file(handle.map, handle.psize, handle.root, key)
                    if not inside:
                        what = "is missing" if inside is None else "lies outside the file"
                        raise PackError(f"{self.path}: the value of key {key[:60]!r} {what}")
                    values.append(bytes(txn.get(key)))
        except lmdb.Error as error:
            raise PackError(f"{self.path}: damaged LMDB environment ({error})") from None
        if self.decode is None:
            return values
        return [self.decode(value) for value in values]

    def _row(self, index: int) -> int:
        return sample_row(index, len(self), self.path)

    def _check_unchanged(self) -> None:
        # NOTE [ Fork-safe readers ] in packfile.py
        if file_identity(self._data) != self._identity:
            raise PackError(
                f"{self.path}: the environment changed since this dataset opened it: create "
                f"the dataset again"
            )

    def _open(self) -> _Handle:
        return _shared.acquire(self.path, self._data, self._subdir, self._identity)

    def _close_handle(self, handle: _Handle) -> None:
        _shared.release(self._identity, handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self)} values)"
