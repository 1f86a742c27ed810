"""PackWriter: records in, one pack file out, without torch (reading it: packfile.py)."""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastloader.formats.metadata import array_checksum, dump_metadata, make_metadata, records_digest
from fastloader.formats.records import HEADER_SIZE, bind_record

__all__ = ["PackWriter"]


class PackWriter:
    """Base of the packed-file writers: records in, one pack file out, complete at ``close()``.

    Args:
        path: the file to write (must not exist).
        store: the store mode recorded in the metadata ("encoded", "raw" or "jpeg").
        classes: class names, indexed by label.
        info: extra JSON-able facts to keep in the metadata (source, options, ...).

    The ``store``, ``classes`` and ``info`` attributes are read when ``close()`` writes the
    metadata, so a caller can still add what it learns while writing (such as a skipped count).
    Subclasses implement ``_open``, ``_put``, ``close`` and ``abort``; the labels and source
    paths are kept here, as the arrays ``close()`` stores (see ``arrays``).

    Raises:
        FileExistsError: if ``path`` exists.
        TypeError: if ``info`` holds something JSON cannot.
    """

    backend = ""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        store: str,
        classes: Sequence[str],
        info: dict | None = None,
    ) -> None:
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{self.path}: already exists")
        self.store = store
        self.classes = list(classes)
        self.info = dict(info or {})
        self.schema: dict | None = None  # a pack of any sample sets it (formats/fields.py)
        self.columns: dict | None = None  # a pack laid out by columns (column_layout.py)
        self.count = self.bytes_written = 0  # records appended so far, and their bytes
        self._labels, self._headers = array("q"), records_digest()  # of what append() stores
        self._sources = bytearray()
        self._source_offsets = array("q", [0])
        self._with_sources: bool | None = None  # decided by the first append
        self.metadata_json({})  # fail before writing anything if the metadata cannot be stored
        self._open()

    def _open(self) -> None:
        """Create the file at ``path`` and whatever writing needs."""
        raise NotImplementedError

    def _put(self, record: bytes) -> None:
        """Store the next record (index ``count``)."""
        raise NotImplementedError

    def append(self, record: bytes, label: int, source: str | None = None) -> None:
        """Add the next record (index ``count``) with its label and, optionally, the path of
        the file it came from (every record has one, or none has).

        Raises:
            ValueError: if some records have a source path and others not.
        """
        if self._with_sources is None:
            self._with_sources = source is not None
        elif self._with_sources != (source is not None):
            raise ValueError("either every record has a source path or none has")
        record = bind_record(record, self.count)  # NOTE [ Checksums bound to positions ]
        self._put(record)
        self._headers.update(record[:HEADER_SIZE])
        self._labels.append(int(label))
        if source is not None:
            self._sources += source.encode("utf-8", "surrogateescape")
            self._source_offsets.append(len(self._sources))
        self.count += 1
        self.bytes_written += len(record)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays stored beside the records: labels, and source paths when recorded."""
        arrays = {"labels": np.frombuffer(self._labels, dtype=np.int64).astype("<i8")}
        if self._with_sources:
            arrays["sources"] = np.frombuffer(bytes(self._sources), dtype=np.uint8)
            arrays["source_offsets"] = np.frombuffer(self._source_offsets, dtype=np.int64).astype(
                "<i8"
            )
        return arrays

    def metadata_json(self, arrays: dict[str, np.ndarray]) -> bytes:
        """The metadata, as JSON, of the records appended so far and of ``arrays``."""
        checksums = {name: array_checksum(data) for name, data in arrays.items()}
        if self.columns is None:  # and the records: NOTE [ Metadata checksums ] in metadata.py
            checksums["records"] = self._headers.hexdigest()
        return dump_metadata(
            make_metadata(
                self.backend,
                self.store,
                self.count,
                self.classes,
                self.info,
                checksums,
                bool(self._with_sources),
                self.schema,
                self.columns,
            )
        )

    def close(self) -> None:
        """Write what is left and the metadata, last: the pack is then complete."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        raise NotImplementedError

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
