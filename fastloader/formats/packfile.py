"""PackFile: reading a pack, without torch (writing it: pack_writer.py).

``PackFile`` is the reading core every pack reader shares: lazy, fork-safe opening (see NOTE
[ Fork-safe readers ]), the checked metadata and labels, records read undecoded and verified,
source paths. The torch datasets (``fastloader.datasets.packs``: ``PackedDataset`` and the backends'
datasets) add decoding and transforms on top. ``--info``, ``--verify`` and packing use only this
module and the backends' readers and writers, so they never import torch (see NOTE [ Torch-free
pack files ] in formats/__init__.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.advice import ReadAdvice
from fastloader.formats.column_reader import ColumnTable
from fastloader.formats.records import (
    HEADER_SIZE,
    UNBOUND_VERSION,
    PackError,
    Record,
    checksum_error,
    checksum_matches,
    decode_record,
)

# NOTE [ Fork-safe readers ]
# An LMDB environment or HDF5 file opened in one process must not be used by another: a forked
# worker that inherits the parent's handle shares its file offsets, locks and caches, which
# crashes or silently corrupts reads. So a dataset holds no open handle when it is created or
# pickled: it opens its file on first read in the process that reads, remembers that process's
# pid, and opens a new handle when it finds itself in a different process (a fork). The handle is
# never part of the pickled state, so spawn and forkserver workers open their own too. (LMDB
# needs one more step: see _Environments in lmdb.py.) A reopened file must still be the file the
# dataset was created over: a pack re-packed in place since (`--overwrite`) is refused, naming it,
# rather than read with the old labels and length. An LMDB pack keeps the handle that read its
# index as the creating process's (``keeps_index_handle``): it reads from its own map of the file
# (NOTE [ LMDB values checked against the file ]), and opening it again cost a sharded pack's
# every shard a second LMDB environment and column table (1 ms of a 3 ms open). That process
# reads the file it was created over; other processes open their own, checked, as above.


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """What tells one file from another at the same path: device, inode, size, mtime."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def check_file(path: Path) -> None:
    """Refuse, naming the file, what cannot be a pack before any backend reads it.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: for a folder or an empty file.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise PackError(f"{path}: is a directory, not a packed file")
    if path.stat().st_size == 0:
        raise PackError(f"{path}: empty file (0 bytes), not a pack: an interrupted copy?")


# NOTE [ Checksum after the copy ]
# Every read verifies the record's checksum (NOTE [ Record checksums ]) over the bytes in the
# file. Hashing costs least right after the bytes were read: a raw record (150-200 KB) is not
# in the CPU caches when a batch asks for it, and whichever pass touches it first pays for
# bringing it from memory. Hashed first, the copy that follows re-reads it from L2 but the hash
# paid the memory trip; copied first, the copy pays that trip (it must anyway) and the hash then
# reads the bytes hot: measured 1.3-1.7 us less per 200 KB record on the shared box (about a
# third of the checksum's cost on a copy-only read). So a sample is decoded (and, for fused
# transforms, cropped) first and its record's checksum verified right after, before the sample
# is returned or a user's transform sees it (`_checked`); the header is parsed and checked
# before (so a damaged length or shape never reads outside the record). Nothing is covered
# less: the same header and payload bytes of the file are hashed, and a record that fails to
# parse or decode is hashed before its error is raised, so a damaged record still reports
# "checksum mismatch", whatever part was damaged. `verify` (whole-pack checking) hashes first:
# it copies nothing.


def sample_row(index: Any, count: int, path: Path) -> int:
    """The row of sample ``index`` (an int, NumPy int or 0-d tensor; negative counts from the
    end) among ``count`` samples of the file at ``path``.

    Raises:
        TypeError: for an index that is not an integer.
        IndexError: naming the file, for an index out of range.
    """
    if isinstance(index, np.integer) or is_tensor(index):
        index = int(index)
    if not isinstance(index, int):
        raise TypeError(f"index must be an int, got {type(index).__name__}")
    row = index + count if index < 0 else index
    if not 0 <= row < count:
        raise IndexError(f"index {index} out of range for {count} samples in {path}")
    return row


class ForkSafeFile:
    """A file opened lazily in each process that reads it, and never pickled open.

    The pattern every reader shares (packs and users' own files): see NOTE [ Fork-safe
    readers ]. A subclass sets ``self._handle = self._pid = None`` in ``__init__`` and defines
    ``_open()`` (this process's handle), ``_close_handle(handle)`` and ``_check_unchanged()``
    (raise if the file is not the one the reader was made for).
    """

    #: Attributes that belong to one process: left out of pickles, dropped by ``close()``.
    _PER_PROCESS: tuple[str, ...] = ("_handle", "_pid")

    _handle: Any
    _pid: int | None

    def _open(self) -> Any:
        raise NotImplementedError

    def _close_handle(self, handle: Any) -> None:
        raise NotImplementedError

    def _check_unchanged(self) -> None:
        raise NotImplementedError

    def _handle_here(self) -> Any:
        """This process's open handle, opened on first use after a fork or unpickling."""
        pid = os.getpid()
        if self._handle is None or self._pid != pid:
            self._check_unchanged()
            self._handle = self._open()
            self._pid = pid
        return self._handle

    def close(self) -> None:
        """Close the file in this process (it reopens on the next read)."""
        if self._handle is not None and self._pid == os.getpid():
            self._close_handle(self._handle)
        for name in self._PER_PROCESS:
            setattr(self, name, None)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(dict.fromkeys(self._PER_PROCESS))
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


class PackFile(ForkSafeFile):
    """The reading core of a pack over one file: metadata, labels, checked records, sources.

    Subclasses implement ``_open``, ``_load_index``, ``_read_each`` and ``_read_source``.

    Args:
        path: the pack file.
        verify_checksums: check each record's checksum as it is read (default True).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is not a complete, readable pack of this backend.
    """

    backend = ""
    #: Keep the handle that read the index as this process's (else it is opened again to read)
    keeps_index_handle = False
    #: Advise the pack's memory map for the order it is read in (NOTE [ Read advice for packs
    #: bigger than memory ] in formats/advice.py); set False on a dataset to read without.
    read_advice = True

    def __init__(self, path: str | os.PathLike, *, verify_checksums: bool = True) -> None:
        self.path = Path(path)
        self.verify_checksums = verify_checksums
        check_file(self.path)
        self._handle: Any = None
        self._pid: int | None = None
        self._identity = file_identity(self.path)
        handle = self._open()
        try:
            self.metadata, self.targets = self._load_index(handle)
        except BaseException:
            self._close_handle(handle)
            raise
        if self.keeps_index_handle:  # NOTE [ Fork-safe readers ]
            self._handle, self._pid = handle, os.getpid()
        else:
            self._close_handle(handle)
        # Records are checked as the record at their position, from format 3 on (NOTE
        # [ Checksums bound to positions ]); format-2 checksums are unbound (seed 0).
        self._bound = self.metadata["version"] > UNBOUND_VERSION
        self.classes: list[str] = list(self.metadata["classes"])
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}
        self.store: str = self.metadata["store"]
        #: how samples of many fields are stored (formats/fields.py); None: (image, label)
        self.schema: dict | None = self.metadata.get("schema")
        #: "columns" (format 5: NOTE [ Packs laid out by columns ]) or "records"
        self.layout = "columns" if "columns" in self.metadata else "records"

    # --- backend interface -------------------------------------------------------------------
    def _open(self) -> Any:
        """Open the file read-only; raise PackError naming it if it cannot be a pack."""
        raise NotImplementedError

    def _load_index(self, handle: Any) -> tuple[dict, np.ndarray]:
        """Return the checked metadata and the int64 labels."""
        raise NotImplementedError

    def _read_each(self, handle: Any, indices: Sequence[int], use: Callable) -> list:
        """Return ``[use(i, buffer) for i in indices]``, in order, in one read transaction."""
        raise NotImplementedError

    def _read_source(self, handle: Any, position: int) -> bytes:
        """Return the UTF-8 source path of record ``position`` (the pack records sources)."""
        raise NotImplementedError

    def _close_handle(self, handle: Any) -> None:
        handle.close()

    def _record_spans(
        self, handle: Any, positions: Sequence[int], advice: ReadAdvice
    ) -> tuple[Any, Any] | None:
        """``(mmap, spans)``: the map records are read from and each record's (offset in it,
        length), for ``advice``; None where the backend reads no such map."""
        return None

    def _column_part(self, handle: Any, name: str, segment: int) -> np.ndarray | None:
        """The bytes of a column part (``column_layout.part_name``) as a uint8 array."""
        raise NotImplementedError

    def _handle_cache(self, handle: Any) -> dict:
        """A dict that lives as long as ``handle`` (what is read through it)."""
        raise NotImplementedError

    # --- reading -------------------------------------------------------------------------------
    def column_table(self) -> ColumnTable:
        """This process's ``ColumnTable`` of a pack laid out by columns (format 5), made once
        per open handle (NOTE [ Blocks checked once per process ] in column_reader.py)."""
        handle = self._handle_here()
        cache = self._handle_cache(handle)
        table = cache.get("columns")
        if table is None:
            table = cache["columns"] = self._column_table(handle)
        return table

    def _column_table(self, handle: Any) -> ColumnTable:
        part = lambda name, segment: self._column_part(handle, name, segment)  # noqa: E731
        return ColumnTable(self.path, self.metadata, part)

    def __len__(self) -> int:
        return len(self.targets)

    def read_record(self, index: int) -> Record:
        """Return record ``index`` undecoded (its payload copied out of the file).

        Raises:
            PackError: for a pack laid out by columns, which has no records.
        """
        if self.layout == "columns":
            raise PackError(f"{self.path}: laid out by columns (format 5): it has no records")

        def copy(position: int, buffer: Any) -> Record:
            def copied(record: Record) -> Record:
                return record._replace(payload=memoryview(bytes(record.payload)))

            return self._checked(position, buffer, copied)

        return self._read_each(self._handle_here(), [self._position(index)], copy)[0]

    def source_path(self, index: int) -> str | None:
        """The path, relative to the packed folder, of the file sample ``index`` came from.

        Read from the file on demand (no list of paths is kept in memory). ``None`` for a pack
        made from a dataset, which has no files.

        Raises:
            IndexError: for an index out of range.
            PackError: if the stored paths are damaged.
        """
        position = self._position(index)
        if not self.metadata["sources"]:
            return None
        raw = self._read_source(self._handle_here(), position)
        try:
            return raw.decode("utf-8", "surrogateescape")
        except UnicodeDecodeError:  # pragma: no cover - surrogateescape decodes any bytes
            raise PackError(f"{self.path}: damaged source path of record {position}") from None

    def advise_records(self, positions: Sequence[int]) -> None:
        """Advise the pack's map before records ``positions`` (checked, non-negative) are read.

        See NOTE [ Read advice for packs bigger than memory ] in formats/advice.py: random
        orders read only each record's pages, and a batch's records are asked for at once.
        Does nothing when ``read_advice`` is False. Never raises for a damaged record (its read
        does).
        """
        if not self.read_advice or not positions or self.layout == "columns":
            return
        handle = self._handle_here()
        current = self.__dict__.get("_advice")
        if current is None or current[0] is not handle:  # a new handle maps the file anew
            current = (handle, ReadAdvice())
            self._advice = current
        target = self._record_spans(handle, positions, current[1])
        if target is not None:
            current[1].before_read(target[0], positions, target[1])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, {len(self)} samples, "
            f"{len(self.classes)} classes, store={self.store!r})"
        )

    # --- helpers -------------------------------------------------------------------------------
    _PER_PROCESS = ("_handle", "_pid", "_advice")  # the read advice holds the handle

    def _check_unchanged(self) -> None:
        check_file(self.path)
        if file_identity(self.path) != self._identity:
            raise PackError(
                f"{self.path}: the file changed since this dataset opened it (re-packed or "
                f"replaced): create the dataset again"
            )

    def _position(self, index: int) -> int:
        return sample_row(index, len(self.targets), self.path)

    def _record(self, position: int, buffer: Any, *, checked_later: bool = False) -> Record:
        """Parse record ``position`` from ``buffer``; its checksum is verified now unless
        ``checked_later`` (then the caller runs ``_checked``: NOTE [ Checksum after the copy ]).
        """
        if buffer is None:
            raise PackError(f"{self.path} record {position}: missing (corrupt pack)")
        where = f"{self.path} record {position}"
        try:
            record = decode_record(
                buffer,
                where=where,
                verify=self.verify_checksums and not checked_later,
                position=position if self._bound else 0,
            )
            if record.label != self.targets[position]:
                raise PackError(f"{where}: its label differs from the label index")
        except PackError as error:
            # A damaged record says so, as when its checksum is verified first.
            if checked_later and self.verify_checksums and len(buffer) >= HEADER_SIZE:
                self._raise_if_damaged(buffer, position, error)
            raise
        return record

    def _checked(self, position: int, buffer: Any, use: Callable[[Record], Any]) -> Any:
        """``use(record)`` for record ``position``, its checksum verified right after.

        See NOTE [ Checksum after the copy ]. ``use`` must return nothing that refers to
        ``buffer``. Errors as ``_record``'s; an error raised by ``use`` on a record whose
        checksum does not match becomes the checksum error.
        """
        if not self.verify_checksums:
            return use(self._record(position, buffer))
        record = self._record(position, buffer, checked_later=True)
        try:
            result = use(record)
        except Exception as error:
            self._raise_if_damaged(buffer, position, error)
            raise
        if not checksum_matches(buffer, position if self._bound else 0):
            self._raise_if_damaged(buffer, position, None)
        return result

    def _raise_if_damaged(self, buffer: Any, position: int, cause: BaseException | None) -> None:
        where = f"{self.path} record {position}"
        damaged = checksum_error(buffer, where, position if self._bound else 0)
        if damaged is not None:
            raise damaged from cause


def is_tensor(value: Any) -> bool:
    """``isinstance(value, torch.Tensor)``, without importing torch: a tensor exists only once
    torch is imported (NOTE [ Torch-free pack files ] in formats/__init__.py)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
