"""Checking a whole pack: every record's checksum and header, and all metadata.

``fastloader.verify(path)`` returns a report; ``run_cli`` is what ``fastloader-pack --verify``
runs. Opening the pack already checks the metadata (its checksum and every field), the labels,
offsets and source paths (their checksums) and the file's structure; then every record is read
and checked as a training read checks it (checksum, header, label against the label index,
and in a pack of any sample every field decoded as a read decodes it), without decoding
images: the checksum already covers every stored byte; the records' headers, in order, are
checked against the metadata's ``records`` checksum where it has one (NOTE [ Metadata
checksums ] in metadata.py: records from another pack). A pack laid out by columns (format 5)
has every block of rows of every field hashed, and every ragged value decoded; a bad block is
reported by its first row, the reason naming the field and the rows.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fastloader.formats.fields import FieldsDecoder
from fastloader.formats.metadata import records_digest
from fastloader.formats.records import HEADER_SIZE, PackError, RecordKind

PROG = "fastloader-pack"
_CHUNK = 1024  # records per read transaction


@dataclass
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
        path: the pack checked.
        records: how many records it holds (all were checked).
        bad: ``(index, reason)`` of every record that failed, in index order.
        seconds: how long checking took.
    """

    path: Path
    records: int
    bad: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every record passed."""
        return not self.bad

    @property
    def records_per_s(self) -> float:
        """Records checked per second."""
        return self.records / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        verdict = "OK" if self.ok else f"{len(self.bad)} bad records"
        return (
            f"{self.path}: {verdict}: {self.records} records and the metadata checked in "
            f"{self.seconds:.1f} s ({self.records_per_s:,.0f} records/s)"
        )


def verify(path: str | os.PathLike, progress: bool | None = None) -> VerifyReport:
    """Check every record and all metadata of the pack at ``path``.

    Args:
        path: a pack of either format.
        progress: show a progress bar on stderr; default when stderr is a terminal.

    Returns:
        a :class:`VerifyReport` listing every bad record (index and reason).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: naming the file, if it cannot be opened as a pack at all (not a pack,
            truncated, damaged metadata, labels, offsets or structure).
    """
    from fastloader.formats import open_pack_file

    started = time.perf_counter()
    dataset = open_pack_file(path)
    try:
        count = len(dataset)
        bad: list[tuple[int, str]] = []
        show = sys.stderr.isatty() if progress is None else progress
        if dataset.layout == "columns":  # every block of every field (column_reader.py)
            bad = dataset.column_table().verify()
            return VerifyReport(Path(path), count, bad, time.perf_counter() - started)
        headers = records_digest()
        with tqdm(
            total=count, desc=f"verify {dataset.path.name}", unit="rec", disable=not show
        ) as bar:
            for start in range(0, count, _CHUNK):
                positions = range(start, min(start + _CHUNK, count))
                bad += _check_chunk(dataset, positions, headers)
                bar.update(len(positions))
        if not bad:
            _check_records_checksum(dataset, headers.hexdigest())
    finally:
        dataset.close()
    return VerifyReport(Path(path), count, bad, time.perf_counter() - started)


def _check_records_checksum(dataset: Any, computed: str) -> None:
    """Raise PackError naming the pack if its records' headers are not those its metadata's
    ``records`` checksum names (NOTE [ Metadata checksums ]); a pack without one passes."""
    stored = dataset.metadata["checksums"].get("records")
    if stored is not None and stored != computed:
        raise PackError(
            f"{dataset.path}: its records are not the ones its metadata was written with "
            f"(records checksum {computed}, the metadata's {stored}): records of another pack?"
        )


def _check_chunk(dataset, positions: range, headers: Any) -> list[tuple[int, str]]:
    """Check records at ``positions`` in one transaction; one by one if the file fails.
    ``headers`` is fed each good record's header, in order (NOTE [ Metadata checksums ])."""

    decoder = FieldsDecoder(dataset.schema) if dataset.schema is not None else None

    def check(position: int, buffer) -> tuple[int, str] | None:
        try:
            record = dataset._record(position, buffer)
            headers.update(buffer[:HEADER_SIZE])
            if decoder is not None:  # every field read back, as a training read reads it
                where = f"{dataset.path} record {position}"
                if record.kind is not RecordKind.FIELDS:
                    raise PackError(f"{where}: an image record in a pack of fields")
                decoder.decode(record.payload, where, _image_header_only)
        except PackError as error:
            return position, _reason(error, dataset.path)
        return None

    handle = dataset._handle_here()
    try:
        results = dataset._read_each(handle, list(positions), check)
    except PackError:  # a read failed outside a record (LMDB structure): find which, alone
        results = []
        for position in positions:
            try:
                results += dataset._read_each(handle, [position], check)
            except PackError as error:
                results.append((position, _reason(error, dataset.path)))
    return [result for result in results if result is not None]


def _image_header_only(stored: int, shape: Any, data: memoryview, name: str) -> None:
    """An image field, its header already checked by the decoder; its bytes are covered by
    the record's checksum (decoding every image would cost what packing did)."""


def _reason(error: PackError, path: Path) -> str:
    """The message without the file name and record index the report already gives."""
    text = " ".join(str(error).split())
    prefix = f"{path} record "
    if text.startswith(prefix):
        return text[len(prefix) :].split(": ", 1)[-1]
    return text.removeprefix(f"{path}: ")


def run_cli(path: str, quiet: bool = False, prog: str = PROG) -> int:
    """``fastloader-pack --verify PACK``: check a pack, print what is wrong, return the status.

    ``prog`` names the command in an error message (``fastloader verify`` runs this too).

    Bad records are printed one per line on stderr (``PACK: record I: reason``), even with
    ``quiet``; then a summary on stdout unless ``quiet``. Progress is shown on a terminal.

    Returns:
        0 if every record and the metadata are good, 1 if any record is bad, 2 if the file
        cannot be opened as a pack at all (the reason is printed on stderr).
    """
    try:
        report = verify(path, progress=False if quiet else None)
    except (PackError, OSError) as error:
        message = " ".join(str(error).split())
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    for index, reason in report.bad:
        print(f"{path}: record {index}: {reason}", file=sys.stderr)
    if not quiet:
        print(report)
    return 0 if report.ok else 1
