"""LMDB packs: one file (no lock file), a record per sample under its 8-byte big-endian index.

Keys: ``>Q`` index -> record; ``__targets__`` -> int64 labels; ``__metadata__`` -> JSON, written
last, so a file without it is an interrupted run (see records.load_metadata).
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb
import numpy as np

from fastloader.formats.base import PackedDataset, PackWriter
from fastloader.formats.records import (
    PackError,
    check_targets,
    load_metadata,
)

_METADATA_KEY = b"__metadata__"
_TARGETS_KEY = b"__targets__"
_KEY = struct.Struct(">Q")
_MAP_SIZE = 1 << 40  # address space only: the file grows as pages are written
_COMMIT_BYTES = 64 << 20


def _key(index: int) -> bytes:
    return _KEY.pack(index)


class _Environments:
    """Read-only environments shared by the datasets of one process, counted by users.

    py-lmdb refuses to open one file twice in a process, so two datasets over the same pack (a
    dataset and its copy, train and a subset) share one environment. An entry inherited through
    a fork is never used in the child; it is closed there, which only unmaps the child's copy
    (a read-only environment without a lock file has nothing else to release), so that py-lmdb
    lets the child open the file again.
    """

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, lmdb.Environment, int]] = {}

    def acquire(self, path: Path) -> lmdb.Environment:
        key, pid = os.path.realpath(path), os.getpid()
        entry = self._open.get(key)
        if entry is not None and entry[0] == pid:
            self._open[key] = (pid, entry[1], entry[2] + 1)
            return entry[1]
        if entry is not None:
            entry[1].close()
        env = _open_environment(path)
        self._open[key] = (pid, env, 1)
        return env

    def release(self, path: Path) -> None:
        key = os.path.realpath(path)
        entry = self._open.get(key)
        if entry is None or entry[0] != os.getpid():
            return
        if entry[2] > 1:
            self._open[key] = (entry[0], entry[1], entry[2] - 1)
        else:
            del self._open[key]
            entry[1].close()


def _open_environment(path: Path) -> lmdb.Environment:
    try:
        env = lmdb.open(
            str(path),
            subdir=False,
            readonly=True,
            lock=False,
            readahead=False,
            meminit=False,
            max_readers=2048,
        )
    except lmdb.Error as error:
        raise PackError(f"{path}: not a readable LMDB file ({error})") from None
    # A truncated file maps fewer pages than LMDB will touch: reading them would crash the
    # process with SIGBUS, so refuse it here.
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(path)
    if size < needed:
        env.close()
        raise PackError(f"{path}: truncated LMDB file ({size} of {needed} bytes)")
    return env


_environments = _Environments()


class LMDBDataset(PackedDataset):
    """An ImageFolder-like dataset over a pack written by ``fastloader-pack`` in LMDB format.

    Args:
        path: the ``.lmdb`` file.
        transform: applied to each image (as torchvision transforms are).
        target_transform: applied to each label.
        decode: "pil" (RGB image, default), "tensor" (uint8 CHW), "numpy" (uint8 HWC), or
            "bytes" (the stored payload).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is truncated, not a fastloader LMDB pack, unfinished, or from a newer
            fastloader.
        ValueError: for an unknown ``decode``.
    """

    backend = "lmdb"

    def _open(self) -> lmdb.Environment:
        return _environments.acquire(self.path)

    def _close_handle(self, env: lmdb.Environment) -> None:
        _environments.release(self.path)

    def _load_index(self, env: lmdb.Environment) -> tuple[dict, np.ndarray]:
        with env.begin() as txn:
            metadata = load_metadata(txn.get(_METADATA_KEY), self.path, self.backend)
            raw_targets = txn.get(_TARGETS_KEY)
        if raw_targets is None or len(raw_targets) % 8:
            raise PackError(f"{self.path}: corrupt pack (label index missing or damaged)")
        targets = np.frombuffer(raw_targets, "<i8").astype(np.int64)
        return metadata, check_targets(targets, metadata, self.path)

    def _read_each(self, env: lmdb.Environment, indices: Sequence[int], use: Callable) -> list:
        # buffers=True: values are views into the memory map, valid inside the transaction.
        with env.begin(buffers=True) as txn:
            return [use(index, txn.get(_key(index))) for index in indices]


class LMDBWriter(PackWriter):
    """Writes an LMDB pack to exactly ``path``; the file is complete only after ``close()``.

    Arguments and errors as ``PackWriter``.
    """

    backend = "lmdb"

    def _open(self) -> None:
        self._env = lmdb.open(
            str(self.path), subdir=False, map_size=_MAP_SIZE, lock=False, sync=False, meminit=False
        )
        self._txn = self._env.begin(write=True)
        self._pending = 0
        self._labels = array("q")

    def append(self, record: bytes, label: int) -> None:
        self._txn.put(_key(self.count), record, append=True)
        self._labels.append(int(label))
        self.count += 1
        self.bytes_written += len(record)
        self._pending += len(record)
        if self._pending >= _COMMIT_BYTES:
            self._txn.commit()
            self._txn = self._env.begin(write=True)
            self._pending = 0

    def close(self) -> None:
        """Write the labels and metadata, sync and close: the pack is then complete."""
        labels = np.frombuffer(self._labels, dtype=np.int64).astype("<i8")
        self._txn.put(_TARGETS_KEY, labels.tobytes())
        self._txn.put(_METADATA_KEY, self.metadata_json())
        self._txn.commit()
        self._env.sync(True)
        self._env.close()

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        self._txn.abort()
        self._env.close()
