"""A batch read field by field, handed to the loader's default collate as it was read.

NOTE [ Batches read by columns ]

A user's HDF5 file is read one gather per field for the whole batch (NOTE [ Mapped rows ] in
formats/hdf5_foreign.py). Cutting those columns into per-sample dicts, only for the default
collate to stack them back, cost more than the reading: for issue 30's pose batches of 64,
265 us a batch against 70 us for the columns as read. So when the loader's ``collate_fn`` is
fastloader's ``default_collate`` and the dataset is an ``HDF5FileDataset`` without
``transform`` or ``as_tuple`` (no code of the user's runs per sample), the loader asks it for a
``ColumnBatch`` (``read_batch_columns``) instead of the samples, and the collates that know it
turn each numeric column into the batch tensor whole. A pack of fields laid out by columns
(format 5: NOTE [ Packs laid out by columns ] in formats/column_layout.py) offers the same
``read_batch_columns`` (datasets/field_samples.py ``read_columns``), its blocks' checksums
verified first, when no per-sample code runs (NOTE [ One meaning per argument ]):

- in the main process ``default_collate`` wraps the column (``torch.from_numpy``, no copy);
- in a worker each mapped field is gathered straight into the shared-memory slot, one copy
  (``formats.mapped_rows.MappedRows``, ``loader/iterators/slot_collate.py``, NOTE [ Batch
  transport ]): a gather and then a copy into the slot cost twice that (pose images: 120
  against 50 us a batch).

The batch is the one ``default_collate(samples)`` gives, exactly: the same keys in the same
order, dtypes, shapes and values; number and string columns, and anything not a plain
native-order numeric array, go through the collate of the samples' values, column by column.
A column that does not collate is collated again from the samples (``samples()``) for the
error the samples would give. A user's own ``collate_fn`` never sees a ``ColumnBatch``.
"""

from __future__ import annotations

from typing import Any

from fastloader.formats.mapped_rows import gathered

__all__ = ["ColumnBatch"]


class ColumnBatch:
    """Dict samples, read field by field: ``columns`` maps each key, in the samples' order, to
    an array of the batch's rows or a list of its values (see the NOTE)."""

    __slots__ = ("columns", "length")

    def __init__(self, columns: dict[str, Any], length: int) -> None:
        self.columns = columns
        self.length = length

    def __len__(self) -> int:
        return self.length

    def samples(self) -> list[dict[str, Any]]:
        """The batch as the list of dict samples it was read as."""
        columns = {name: gathered(column) for name, column in self.columns.items()}
        return [{name: column[at] for name, column in columns.items()} for at in range(self.length)]
