"""Pack an image folder, or any map-style dataset, into one LMDB or HDF5 file.

Packing is three small stages:

* scan (main process): the samples of an image folder in torchvision ``ImageFolder`` order
  (:func:`scan_image_folder`), or the indices of a dataset;
* encode (worker processes): one sample -> the bytes of one record, or the reason it is skipped
  (:func:`encode_file`, :func:`encode_image`; see NOTE [ Packing workers ]);
* write (main process): one writer appends the records in index order, then the file is renamed
  into place (see NOTE [ Atomic packing ]).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fastloader.formats import open_writer
from fastloader.formats.signatures import is_hdf5_file
from fastloader.packing.jobs import Job, dataset_job, folder_job, scan_image_folder, shuffled
from fastloader.packing.options import (
    check_options,
    check_target,
    default_workers,
    start_method,
    target_format,
)
from fastloader.packing.output import file_identity, free_bytes, publish, storage_error
from fastloader.packing.pool import IMAGE_SECONDS, encode_in_workers
from fastloader.packing.process import partial_path, raise_if_signalled, remove_stale_partials
from fastloader.packing.summary import PackSummary
from fastloader.packing.worker import (
    Encoded,
    Options,
)
from fastloader.shards.stores import is_url
from fastloader.vision.images import CHECKS, IMG_EXTENSIONS

__all__ = ["IMG_EXTENSIONS", "BadImageError", "PackSummary", "pack", "scan_image_folder"]


class BadImageError(ValueError):
    """An input image could not be read, with ``strict=True`` (the message names it and why)."""


# --- encode: runs in the worker processes -----------------------------------------------------


# --- scan and write: run in the main process --------------------------------------------------


def _encode_all(
    encoder: Callable, items: Sequence, workers: int, seconds: float = IMAGE_SECONDS
) -> Iterator[Encoded]:
    """Yield ``encoder(item)`` for every item in order, in ``workers`` processes if > 0
    (see NOTE [ Per-image limits when packing ] in packing/pool.py)."""
    if workers <= 0:
        yield from map(encoder, items)
        return
    yield from encode_in_workers(encoder, items, workers, start_method(), seconds)


# NOTE [ Samples of fields ]
# pack(dataset) writes a pack of (image, label) records when the samples are image-and-int
# pairs, or the dataset says it classifies (a `classes` attribute, or classes=): what
# ImageFolder-like datasets give, and what older fastloader read. Anything else (dicts, tuples
# of other lengths or kinds, or schema=) is a pack of any sample (format 4, formats/fields.py).
# Deciding needs sample 0, read once in this process.


# NOTE [ Atomic packing ]
# The writer writes a hidden temporary file beside the target, `.NAME.partial-PID@HOST`, in the
# same folder so that the final rename is atomic within one file system (and never replaces
# a DST that appeared meanwhile unless asked: NOTE [ Publishing the pack ] in
# packing/output.py). The rename happens only after the writer's close() succeeded and the
# file is synced; close() writes the metadata last, so a temporary file left by a killed run
# never opens as a complete pack. On any exception, KeyboardInterrupt and SIGTERM (via the
# CLI) included, the writer is aborted and the temporary file is removed (a full disk is named:
# NOTE [ Disk full while packing ]); an existing target is untouched until the rename.
# Only SIGKILL (or a power cut) leaves a partial file: each run first removes the partial files
# for its DST whose packer process is dead: written on this host (the name says which; a
# folder may be shared between hosts, whose pids mean nothing here) by a pid that no longer
# runs, or is a zombie. A live pid keeps its file, even if the pid was reused by another
# program: never remove what a running packer writes. Files named without a host (older
# versions) count as this host's.


def pack(
    source: str | os.PathLike | Any,
    path: str | os.PathLike,
    *,
    format: str | None = None,
    store: str = "encoded",
    quality: int = 90,
    max_side: int | None = None,
    short_side: int | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    strict: bool = False,
    progress: bool | None = None,
    classes: Sequence[str] | None = None,
    check: str = "full",
    image_timeout: float = IMAGE_SECONDS,
    schema: dict | None = None,
    shuffle_seed: int | None = None,
    layout: str = "columns",
    shard_size: int | str | None = None,
) -> PackSummary:
    """Pack an image folder or a map-style dataset into one LMDB or HDF5 file.

    Images that cannot be read (unreadable, empty, truncated, not an image) are skipped and
    listed in the summary. The pack is written beside ``path`` and renamed at the end, so
    ``path`` is either the complete pack or untouched (see NOTE [ Atomic packing ]).

    Args:
        source: an image folder in torchvision ``ImageFolder`` layout, or a map-style dataset
            of ``(image, label)`` samples: the image a PIL image, a uint8 array (HW or HWC), a
            uint8 tensor (HW or CHW) or the bytes of an image file; the label an int. Or a
            dataset of samples with fields (see ``schema``), or the path of an HDF5 file of
            aligned datasets (its rows are dict samples; ``schema={"image": "image"}`` stores a
            uint8 dataset as images).
        path: the pack to write.
        format: ``"lmdb"`` or ``"hdf5"``; by default from the suffix of ``path`` (``.lmdb``,
            ``.h5``, ``.hdf5``). An HDF5 pack needs about twice its size free on ``path``'s
            disk while it is written (records are spooled to a temporary file beside it, then
            copied into one contiguous block); LMDB needs its size.
        store: ``"encoded"`` keeps the files' bytes (checked to decode; a dataset's decoded
            images are stored as lossless RGB PNG), ``"raw"`` decoded uint8 HWC RGB pixels,
            ``"jpeg"`` RGB JPEG re-encoded at ``quality``. Pixels are converted to 8-bit RGB.
        quality: the JPEG quality for ``store="jpeg"`` (1-100).
        max_side: for ``raw`` and ``jpeg``, shrink images whose longer side is larger.
        short_side: for ``raw`` and ``jpeg``, shrink images whose shorter side is larger (as
            torchvision's ``Resize(n)``; store at the size you train at and reading needs no
            resize). With both, images fit both; images are never enlarged.
        workers: processes that decode and encode; default all usable CPUs, except for an
            image folder with ``store="encoded"`` and ``check="quick"``, whose files are only
            checked, in this process; 0 encodes in this process (without ``image_timeout``),
            as does a dataset that cannot be pickled when workers do not fork.
        overwrite: replace an existing ``path``.
        shuffle_seed: write the samples in an order shuffled by this seed (numpy's
            ``default_rng(seed).permutation``) instead of the source's, so that consecutive
            records are a random sample: what ``samplers.BlockShuffleSampler`` needs to be
            random enough (docs/bigger-than-memory.md). ``ds.source_path(i)`` still names
            each record's file.
        strict: fail on the first image that cannot be read instead of skipping it.
        progress: show a progress bar on stderr; default when stderr is a terminal.
        classes: for a dataset, the class names; default ``dataset.classes``, else ``"0"`` up to
            the largest label (which needs ``dataset.targets`` or one more pass for labels).
        check: ``"full"`` (default) decodes every image stored, JPEGs strictly at their smallest
            DCT scale, so a file damaged anywhere is skipped; ``"quick"`` (weaker, faster for
            ``store="encoded"``) only checks each file's header and end marker, finding
            truncated files but not damage inside them. A JPEG the strict check refuses only
            for a harmless reason (junk between segments, a bad ICC marker, an unusual chroma
            subsampling) is packed when Pillow loads it (NOTE [ Pillow decides what is
            unreadable ]). Either way bombs are skipped: more pixels than Pillow allows
            (``PIL.Image.MAX_IMAGE_PIXELS``), or, in worker processes, longer than
            ``image_timeout`` to encode (see NOTE [ Per-image limits when packing ]).
        image_timeout: the seconds one image may take in a worker process before it is
            stopped and skipped.
        schema: for a dataset of samples with fields (dicts, or tuples other than ``(image,
            label)``: a pack of any sample, see docs/any-sample.md), ``{field: kind}`` for the
            fields whose kind is not what sample 0 shows (``{"image": "image"}`` stores a uint8
            array as an image), or a whole schema. Each sample is checked against the schema
            inferred from sample 0 and this.
        layout: for a pack of fields, ``"columns"`` (default: format 5, read a batch at a time,
            checksums per block of rows: NOTE [ Packs laid out by columns ]) or ``"records"``
            (format 4, one record per sample: what fastloader before format 5 reads). Packs
            of (image, label) are always records.
        shard_size: write a sharded pack instead: a folder (or an ``s3://bucket/prefix``
            URL) ``path`` of packs of about this many bytes each (``"64MB"``) plus a
            manifest written last (docs/remote.md; NOTE [ Packing shards ] in
            packing/sharded.py). Returns a ``ShardedSummary`` then.

    Returns:
        a :class:`PackSummary` of what was written and skipped.

    Raises:
        FileNotFoundError: if the source folder is missing, has no class folder or a class
            folder without images, or the folder of ``path`` does not exist.
        FileExistsError: if ``path`` exists and ``overwrite`` is False, at the start or when
            the pack is renamed into place (another packer wrote it meanwhile).
        DiskFullError: (an OSError) when the pack does not fit on ``path``'s file system,
            naming it and the space needed; no file is left.
        PermissionError, NotADirectoryError, IsADirectoryError: if ``path`` cannot be written.
        ValueError: for a bad option, an unknown suffix without ``format``, a label out of
            range (naming the sample), or when no image at all could be read.
        BadImageError: with ``strict=True``, naming the first image that cannot be read.
        TypeError: if a dataset sample is not ``(image, int label)``, naming its index.
        SampleSchemaError: (a ValueError) for a sample of fields that does not fit the schema,
            naming its index and the field.
    """
    if shard_size is not None or is_url(path):  # NOTE [ Packing shards ]
        from fastloader.packing.sharded import pack_shards

        if shard_size is None:
            raise ValueError(f"{path}: a URL holds a sharded pack: give shard_size (e.g. '64MB')")
        options = dict(store=store, quality=quality, max_side=max_side, short_side=short_side)
        options.update(workers=workers, strict=strict, check=check, image_timeout=image_timeout)
        options.update(layout=layout)
        return pack_shards(  # type: ignore[return-value]
            pack,
            source,
            path,
            shard_size,
            format=format,
            overwrite=overwrite,
            progress=progress,
            shuffle_seed=shuffle_seed,
            classes=classes,
            schema=schema,
            **options,
        )
    started = time.perf_counter()
    check_options(store, quality, max_side, short_side, format, workers, image_timeout, layout)
    target = Path(os.path.expanduser(os.fspath(path)))
    format = target_format(target, format, source)
    check_target(target, overwrite)
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
    options = Options(store, quality, max_side, short_side, check)
    job = _job(source, options, classes, schema, shuffle_seed)
    if workers is None:
        workers = _default_workers_for(source, store, check)
    workers = min(workers, len(job.items)) if job.parallel else 0
    info = {
        "source": job.source,
        "skipped": None,  # known at the end
        "created_by": "fastloader-pack",
        "max_side": max_side,
        "short_side": short_side,
        "quality": quality if store == "jpeg" else None,
        "check": check,
        "shuffle_seed": shuffle_seed,
    }
    removed_partials = remove_stale_partials(target)
    show = sys.stderr.isatty() if progress is None else progress
    layout = layout if job.schema is not None else "records"
    writer, skipped, replaced = _write_and_publish(
        job, target, (format, layout), store, info, workers, image_timeout, strict, overwrite, show
    )
    _sync(target.parent)
    size, seconds = target.stat().st_size, time.perf_counter() - started
    return PackSummary(
        target,
        format,
        store,
        writer.count,
        job.classes,
        skipped,
        size,
        seconds,
        removed_partials,
        replaced,
    )


def _job(source: Any, options: Options, classes: Any, schema: Any, shuffle_seed: Any) -> Job:
    """What to pack: a folder, a user's HDF5 file (NOTE [ Samples of fields ]) or a dataset."""
    if isinstance(source, (str, os.PathLike)) and is_hdf5_file(source):
        from fastloader.formats.hdf5_foreign import HDF5File

        source = HDF5File(os.path.expanduser(os.fspath(source)))
    if isinstance(source, (str, os.PathLike)):
        if classes is not None:
            raise ValueError("classes= is for datasets: an image folder's classes are its folders")
        job = folder_job(source, options)
    else:
        job = dataset_job(source, options, classes, schema)
    return job if shuffle_seed is None else shuffled(job, shuffle_seed)


def _default_workers_for(source: Any, store: str, check: str) -> int:
    """Quick-checking the files of a folder kept as they are (store="encoded") costs less than
    sending them between processes: measured 1.6x faster in this process. The full check
    decodes every image: that is worth the workers."""
    keeps_files = store == "encoded" and isinstance(source, (str, os.PathLike))
    return 0 if keeps_files and check == "quick" else default_workers()


def _write_and_publish(
    job: Job,
    target: Path,
    format: tuple[str, str],
    store: str,
    info: dict,
    workers: int,
    image_timeout: float,
    strict: bool,
    overwrite: bool,
    show: bool,
) -> tuple[Any, list[tuple[str, str]], str | None]:
    """Write the partial file, then rename it into place (NOTE [ Atomic packing ]);
    ``format`` is (format, layout)."""
    temp = partial_path(target)
    seen, free = file_identity(target), free_bytes(target.parent)
    writer = None
    try:
        format, layout = format
        writer = open_writer(
            temp, format, store=store, classes=job.classes, info=info, layout=layout
        )
        writer.schema = job.schema
        results = _encode_all(job.encoder, job.items, workers, image_timeout)
        bar = tqdm(total=len(job.items), desc=target.name, unit="img", disable=not show)
        with contextlib.closing(results), bar:
            skipped = _write_all(writer, results, job.name, strict, bar, job.relative)
        if writer.count == 0:
            where, reason = skipped[0]
            raise ValueError(f"no image could be read from {job.source} (first: {where}: {reason})")
        writer.info["skipped"] = len(skipped)
        writer.close()
        _sync(temp)
        raise_if_signalled()  # see NOTE [ Signals while packing ]
        replaced = publish(temp, target, overwrite, seen)  # NOTE [ Publishing the pack ]
    except BaseException as error:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.abort()
        full = None
        if not isinstance(error, FileExistsError):
            count, written = (0, 0) if writer is None else (writer.count, writer.bytes_written)
            full = storage_error(error, target, written, count, len(job.items), free)
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        if full is not None:  # see NOTE [ Disk full while packing ]
            raise full from error
        raise
    return writer, skipped, replaced


def _write_all(
    writer: Any,
    results: Iterable[Encoded],
    name: Callable,
    strict: bool,
    bar: tqdm,
    relative: Callable[[int], str] | None = None,
) -> list[tuple[str, str]]:
    """Append every record in order, with its source path if any; return the skipped
    ``(name, reason)`` pairs."""
    skipped = []
    for index, result in enumerate(results):
        if result.reason is None:
            source = None if relative is None else relative(index)
            writer.append(result.record, result.label, source)
        elif strict:
            raise BadImageError(f"{name(index)}: {result.reason}")
        else:
            skipped.append((name(index), result.reason))
        bar.update()
        raise_if_signalled()  # see NOTE [ Signals while packing ]
    return skipped


def _sync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk (best effort for folders)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(handle)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(handle)
