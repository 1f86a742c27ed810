"""Writing an LMDB pack of fields laid out by columns (format 5).

The reader is ``LMDBPack`` (lmdb.py), which reads a column part from fastloader's own map of
the file at the span of its key (NOTE [ Packs laid out by columns ] in column_layout.py).
"""

from __future__ import annotations

from fastloader.formats import column_layout
from fastloader.formats.column_layout import ColumnSpool, column_key
from fastloader.formats.lmdb import (
    _METADATA_KEY,
    _SOURCE_OFFSETS_KEY,
    _SOURCES_KEY,
    LMDBWriter,
)

__all__ = ["LMDBColumnWriter"]


class LMDBColumnWriter(LMDBWriter):
    """Writes an LMDB pack of fields laid out by columns (format 5) to exactly ``path``.

    Records appended (FIELDS, from the packing workers) are taken apart into columns spooled
    beside the pack; ``close()`` writes each part as a value, a data segment per transaction
    (NOTE [ Packs laid out by columns ]). Arguments and errors as ``PackWriter``.
    """

    def _put(self, record: bytes) -> None:
        if self.__dict__.get("_spool") is None:
            self._spool = ColumnSpool(self.schema, self.path.parent)
        self._spool.add(record)

    def close(self) -> None:
        """Write every column part, the source paths and the metadata: now complete."""
        small = {}
        for name, segment, data in self._spool.parts(column_layout.SEGMENT_BYTES):
            self._write(column_key(name, segment), memoryview(data))
            if name.endswith(".data"):
                self._commit()  # a segment's pages, and no more, held in memory
                self._txn = self._env.begin(write=True)
            else:
                small[name] = data
        self.columns = self._spool.layout
        arrays = self.arrays()
        if "sources" in arrays:
            self._write(_SOURCES_KEY, arrays["sources"].tobytes())
            self._write(_SOURCE_OFFSETS_KEY, arrays["source_offsets"].tobytes())
            small.update(sources=arrays["sources"], source_offsets=arrays["source_offsets"])
        self._write(_METADATA_KEY, self.metadata_json(small))
        self._commit()
        self._env.sync(True)
        self._env.close()
        self._spool.close()

    def abort(self) -> None:
        super().abort()
        if self.__dict__.get("_spool") is not None:
            self._spool.close()
