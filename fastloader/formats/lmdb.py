"""LMDB packs: one file (no lock file), a record per sample under its 8-byte big-endian index.

A pack laid out by columns (format 5) has no records: each column part is a value under
``column_key`` (NOTE [ Packs laid out by columns ] in column_layout.py), read from
fastloader's own map of the file at spans walked and checked as records' are.

Keys: ``>Q`` index -> record; ``__targets__`` -> int64 labels; with source paths,
``__sources__`` -> their UTF-8 bytes back to back and ``__source_offsets__`` -> int64 offsets
(count + 1); ``__metadata__`` -> JSON, written last, so a file without it is an interrupted run
(see metadata.load_metadata).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lmdb
import numpy as np

from fastloader.formats.advice import ReadAdvice
from fastloader.formats.column_layout import column_key, column_key_count
from fastloader.formats.lmdb_checks import (
    LeafDamaged,
    RecordSpans,
    check_lmdb_file,
    record_key,
    value_span,
)
from fastloader.formats.metadata import check_array, check_targets, load_metadata
from fastloader.formats.pack_writer import PackWriter
from fastloader.formats.packfile import PackFile, file_identity
from fastloader.formats.records import PackError

_METADATA_KEY = b"__metadata__"
_TARGETS_KEY = b"__targets__"
_SOURCES_KEY = b"__sources__"
_SOURCE_OFFSETS_KEY = b"__source_offsets__"
_FIRST_MAP_SIZE = 64 << 20  # NOTE [ The writer's map grows with the data ]
_COMMIT_BYTES = 64 << 20


class _Env(NamedTuple):
    """An open environment and the file it maps."""

    env: lmdb.Environment
    identity: tuple[int, int, int, int]
    size: int
    file: mmap.mmap  # our own read-only map of the file, to check nodes before LMDB reads them
    view: memoryview  # of ``file``: records are read from it (NOTE [ Record spans ])
    psize: int
    root: int
    # "records": RecordSpans made at the first record read; "columns": the ColumnTable
    spans: dict[str, Any]

    def close(self) -> None:
        self.env.close()
        self.view.release()
        try:
            self.file.close()
        except BufferError:  # a record view still alive: unmapped when the last one goes
            pass


# NOTE [ LMDB values checked against the file ]
# LMDB trusts the file: a value's page number and size come from the leaf node as stored, and
# are handed back as a view into the memory map without a check. py-lmdb's default map is
# 10 MiB (or the size the meta page declares: up to twice the pack for our writer), larger
# than a small pack: a damaged size or overflow-page number then gives a view that runs past
# the end of the file but inside the mapping, and touching it kills the process with SIGBUS
# (what the fuzzing of issue 10 found; in a DataLoader worker torch reports it as "out of
# shared memory"). Three steps close that class:
# 1. before LMDB opens a file, its two meta pages are parsed and checked (lmdb_checks.py): page
#    size, last page and root page against the file size, so every page LMDB walks to is in it;
# 2. the map is only as large as the file (map_size = file size; LMDB raises it only to its
#    last page, already checked to be inside the file);
# 3. no value is read through LMDB: every value (records, column parts, the metadata, labels
#    and source paths) is read from our own read-only map of the file, at the span found by
#    walking the path to it in that map (lmdb_checks.value_span): page numbers, node offsets,
#    the value's size and its overflow page, all checked against the file. (py-lmdb reads one
#    byte of every page of a value before handing it back, so a stored size that ran past the
#    map crashed the process before a check on the returned view could run; and finding where
#    LMDB's own map lies meant reading /proc/self/maps, 2 ms an open with many shards open.)
#    Records' spans are checked once per leaf page (NOTE [ Record spans ] in lmdb_checks.py),
#    which makes the check nearly free per read. LMDB itself only opens the file and counts
#    its entries.


class _Environments:
    """Read-only environments shared by the datasets of one process, counted by users.

    py-lmdb refuses to open one file twice in a process, so two datasets over the same pack (a
    dataset and its copy, train and a subset) share one environment, but only while it is the
    same file: entries are keyed by (device, inode, size, mtime), so a pack re-packed at the
    same path opens the new file while datasets over the old one keep theirs. An entry
    inherited through a fork is never used in the child; it is closed there, which only unmaps
    the child's copy (a read-only environment without a lock file has nothing else to release),
    so that py-lmdb lets the child open the file again.
    """

    def __init__(self) -> None:
        self._open: dict[tuple[int, int, int, int], tuple[int, _Env, int]] = {}

    def acquire(self, path: Path) -> _Env:
        identity, pid = file_identity(path), os.getpid()
        entry = self._open.get(identity)
        if entry is not None and entry[0] == pid:
            self._open[identity] = (pid, entry[1], entry[2] + 1)
            return entry[1]
        if entry is not None:
            entry[1].close()
        handle = _open_environment(path, identity)
        self._open[identity] = (pid, handle, 1)
        return handle

    def release(self, handle: _Env) -> None:
        entry = self._open.get(handle.identity)
        if entry is None or entry[0] != os.getpid() or entry[1] is not handle:
            return
        if entry[2] > 1:
            self._open[handle.identity] = (entry[0], entry[1], entry[2] - 1)
        else:
            del self._open[handle.identity]
            handle.close()


def _open_environment(path: Path, identity: tuple[int, int, int, int]) -> _Env:
    size = identity[2]
    # step 1 of NOTE [ LMDB values checked against the file ]
    psize, root = check_lmdb_file(path, size)
    try:
        env = lmdb.open(
            str(path),
            subdir=False,
            readonly=True,
            lock=False,
            readahead=False,
            meminit=False,
            max_readers=2048,
            map_size=size,  # step 2
        )
    except lmdb.Error as error:
        raise PackError(f"{path}: not a readable LMDB file ({error})") from None
    try:
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if size < needed or env.info()["map_size"] > max(size, needed):
            raise PackError(f"{path}: truncated LMDB file ({size} of {needed} bytes)")
        if file_identity(path) != identity:
            raise PackError(f"{path}: the file changed while it was being opened")
        with open(path, "rb") as opened:
            file = mmap.mmap(opened.fileno(), size, access=mmap.ACCESS_READ)
    except lmdb.Error as error:
        env.close()
        raise PackError(f"{path}: damaged LMDB file ({error})") from None
    except BaseException:
        env.close()
        raise
    return _Env(env, identity, size, file, memoryview(file), psize, root, {})


_environments = _Environments()


class LMDBPack(PackFile):
    """The torch-free reader of a pack written by ``fastloader-pack`` in LMDB format.

    ``--info``, ``--verify`` and ``read_metadata`` use it; ``LMDBDataset``
    (fastloader/datasets/packs.py) is this reader with decoding and transforms. Arguments and errors
    as ``PackFile``.
    """

    backend = "lmdb"
    keeps_index_handle = True  # NOTE [ Fork-safe readers ] in packfile.py

    def _open(self) -> _Env:
        return _environments.acquire(self.path)

    def _close_handle(self, handle: _Env) -> None:
        _environments.release(handle)

    def _get(self, handle: _Env, key: bytes, what: str) -> memoryview | None:
        """The value under ``key``, read from fastloader's own map of the file at the span
        walked and checked in it (step 3 of NOTE [ LMDB values checked against the file ])."""
        span = value_span(handle.file, handle.psize, handle.root, key)
        if span is None:
            return None
        if span is False or span[0] + span[1] > handle.size:
            raise PackError(f"{self.path}: damaged LMDB file ({what} lies outside the file)")
        return handle.view[span[0] : span[0] + span[1]]

    def _load_index(self, handle: _Env) -> tuple[dict, np.ndarray]:
        raw = self._get(handle, _METADATA_KEY, "the metadata")
        metadata = load_metadata(None if raw is None else bytes(raw), self.path, "lmdb")
        if "columns" in metadata:
            targets = None  # no labels: NOTE [ Packs laid out by columns ]
        else:
            raw_targets = self._get(handle, _TARGETS_KEY, "the labels")
            if raw_targets is None or len(raw_targets) % 8:
                raise PackError(f"{self.path}: corrupt pack (label index missing or damaged)")
            targets = np.frombuffer(raw_targets, "<i8").copy()
        if metadata["sources"]:
            self._load_sources(handle, metadata)
        try:
            entries = handle.env.stat()["entries"]
        except lmdb.Error as error:
            raise PackError(f"{self.path}: damaged LMDB file ({error})") from None
        sources = 2 if metadata["sources"] else 0
        if "columns" in metadata:
            self.metadata = metadata  # the table reads it
            expected = column_key_count(metadata) + 1 + sources
        else:
            expected = metadata["count"] + 2 + sources
        if entries != expected:
            raise PackError(
                f"{self.path}: corrupt pack ({entries} LMDB entries for {metadata['count']} "
                f"records)"
            )
        if "columns" in metadata:  # every part checked when the dataset is made
            self._handle_cache(handle)["columns"] = self._column_table(handle)
            return metadata, np.broadcast_to(np.int64(0), (metadata["count"],))
        return metadata, check_targets(targets, metadata, self.path)

    def _handle_cache(self, handle: _Env) -> dict:
        return handle.spans

    def _column_part(self, handle: _Env, name: str, segment: int) -> np.ndarray | None:
        value = self._get(handle, column_key(name, segment), name)
        return None if value is None else np.frombuffer(value, np.uint8)

    def _load_sources(self, handle: _Env, metadata: dict) -> None:
        offsets = self._get(handle, _SOURCE_OFFSETS_KEY, "the source path offsets")
        blob = self._get(handle, _SOURCES_KEY, "the source paths")
        if offsets is None or blob is None or len(offsets) != 8 * (metadata["count"] + 1):
            raise PackError(f"{self.path}: corrupt pack (source paths missing or damaged)")
        check_array(offsets, "source_offsets", metadata, self.path)
        check_array(blob, "sources", metadata, self.path)
        bounds = np.frombuffer(offsets, "<i8")
        if bounds[0] != 0 or bounds[-1] != len(blob) or np.any(np.diff(bounds) < 0):
            raise PackError(f"{self.path}: corrupt pack (source path offsets do not fit)")

    def _read_source(self, handle: _Env, position: int) -> bytes:
        offsets = self._get(handle, _SOURCE_OFFSETS_KEY, "the source path offsets")
        blob = self._get(handle, _SOURCES_KEY, "the source paths")
        if offsets is None or blob is None:
            raise PackError(f"{self.path}: corrupt pack (source paths missing)")
        start, end = struct.unpack_from("<qq", offsets, 8 * position)
        if not 0 <= start <= end <= len(blob):
            raise PackError(f"{self.path}: damaged source path of record {position}")
        return bytes(blob[start:end])

    def _record_spans(
        self, handle: _Env, positions: Sequence[int], advice: ReadAdvice
    ) -> tuple[mmap.mmap, Iterator[tuple[int, int]]]:
        # For read advice (formats/advice.py): the records' spans in our own map, as read below.
        # Lazy: finding a span may fault in its leaf page, which must come after the map's
        # MADV_RANDOM (NOTE [ Read advice for packs bigger than memory ]). A branch page walked
        # for the first time has its children (the leaves) asked for at once.
        spans = self._spans(handle)
        spans.prefetch = lambda pages: advice.willneed_pages(handle.file, pages, handle.psize)

        def found() -> Iterator[tuple[int, int]]:
            for index in positions:
                try:
                    span = spans.span(index)
                except LeafDamaged:
                    continue  # the read raises, naming it
                if span:
                    yield span

        return handle.file, found()

    def _spans(self, handle: _Env) -> RecordSpans:
        spans = handle.spans.get("records")
        if spans is None:
            spans = RecordSpans(handle.file, handle.psize, handle.root, len(self.targets))
            handle.spans["records"] = spans
        return spans

    def _read_each(self, handle: _Env, indices: Sequence[int], use: Callable) -> list:
        # Records are views into fastloader's own map of the file, located and checked by
        # RecordSpans (NOTE [ Record spans ]); py-lmdb reads only the metadata and labels.
        spans = self._spans(handle)
        results = []
        for index in indices:
            try:
                span = spans.span(index)
            except LeafDamaged as damaged:
                raise PackError(
                    f"{self.path}: damaged LMDB file (record {index}: {damaged})"
                ) from None
            if span is False:
                raise PackError(
                    f"{self.path}: damaged LMDB file (record {index} lies outside the file)"
                )
            value = None if span is None else handle.view[span[0] : span[0] + span[1]]
            results.append(use(index, value))
        return results


class LMDBWriter(PackWriter):
    """Writes an LMDB pack to exactly ``path``; the file is complete only after ``close()``.

    Arguments and errors as ``PackWriter``.
    """

    backend = "lmdb"

    # NOTE [ The writer's map grows with the data ]
    # LMDB maps the whole file and reserves its map size in address space up front: a fixed
    # 1 TiB map made packing fail ("Cannot allocate memory") under an address-space limit
    # (``ulimit -v``, as batch schedulers set). The map starts at 64 MiB and doubles when
    # LMDB says it is full: the transaction in progress is aborted, the map grown, and the
    # puts since the last commit (kept until it, at most _COMMIT_BYTES) written again. The
    # address space used is then about twice the pack, never more than the data justifies.
    def _open(self) -> None:
        self._map_size = _FIRST_MAP_SIZE
        self._env = lmdb.open(
            str(self.path),
            subdir=False,
            map_size=self._map_size,
            lock=False,
            sync=False,
            meminit=False,
        )
        self._txn = self._env.begin(write=True)
        self._pending = 0
        self._uncommitted: list[tuple[bytes, bytes, bool]] = []

    def _write(self, key: bytes, value: bytes, *, append: bool = False) -> None:
        """``put`` in the open transaction, growing the map when it is full."""
        self._uncommitted.append((key, value, append))
        try:
            self._txn.put(key, value, append=append)
        except lmdb.MapFullError:
            self._grow()

    def _grow(self) -> None:
        # NOTE [ The writer's map grows with the data ]
        self._txn.abort()
        while True:
            self._map_size *= 2
            self._env.set_mapsize(self._map_size)
            self._txn = self._env.begin(write=True)
            try:
                for key, value, append in self._uncommitted:
                    self._txn.put(key, value, append=append)
                return
            except lmdb.MapFullError:
                self._txn.abort()

    def _commit(self) -> None:
        self._txn.commit()
        self._uncommitted = []
        self._pending = 0

    def _put(self, record: bytes) -> None:
        self._write(record_key(self.count), record, append=True)
        self._pending += len(record)
        if self._pending >= _COMMIT_BYTES:
            self._commit()
            self._txn = self._env.begin(write=True)

    def close(self) -> None:
        """Write the labels, source paths and metadata, sync and close: the pack is complete."""
        arrays = self.arrays()
        self._write(_TARGETS_KEY, arrays["labels"].tobytes())
        if "sources" in arrays:
            self._write(_SOURCES_KEY, arrays["sources"].tobytes())
            self._write(_SOURCE_OFFSETS_KEY, arrays["source_offsets"].tobytes())
        self._write(_METADATA_KEY, self.metadata_json(arrays))
        self._commit()
        self._env.sync(True)
        self._env.close()

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        self._txn.abort()
        self._env.close()
