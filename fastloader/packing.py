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
import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from fastloader._pack_fields import FieldsEncoder, infer_schema, is_fields_sample
from fastloader._pack_output import file_identity, free_bytes, publish, storage_error
from fastloader._pack_pool import IMAGE_SECONDS, encode_in_workers
from fastloader._pack_process import partial_path, raise_if_signalled, remove_stale_partials
from fastloader._pack_worker import (
    DatasetEncoder,
    Encoded,
    FolderEncoder,
    Options,
    check_label,
)
from fastloader.formats import (
    STORE_MODES,
    format_from_suffix,
    open_writer,
)
from fastloader.formats.metadata import human_size
from fastloader.images import CHECKS, IMG_EXTENSIONS, class_folder_files

__all__ = ["IMG_EXTENSIONS", "BadImageError", "PackSummary", "pack", "scan_image_folder"]

#: The file suffixes torchvision's ImageFolder accepts (matched case-insensitively).
FORMATS = ("lmdb", "hdf5")


class BadImageError(ValueError):
    """An input image could not be read, with ``strict=True`` (the message names it and why)."""


@dataclass
class PackSummary:
    """What :func:`pack` wrote.

    Attributes:
        path: the pack written.
        format: ``"lmdb"`` or ``"hdf5"``.
        store: ``"encoded"``, ``"raw"`` or ``"jpeg"``.
        count: the number of records written.
        classes: the class names; a record's label indexes this list.
        skipped: ``(path or dataset index, reason)`` for every input that could not be read.
        size_bytes: the size of the file written.
        seconds: how long packing took.
        removed_partials: ``(path, pid)`` of each partial file of a packer process that no
            longer runs, removed before packing (see NOTE [ Atomic packing ]).
        replaced: with ``overwrite``, a line for the user when the pack replaced a ``path``
            that appeared or changed during the run, else None.
    """

    path: Path
    format: str
    store: str
    count: int
    classes: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    size_bytes: int = 0
    seconds: float = 0.0
    removed_partials: list[tuple[Path, int]] = field(default_factory=list)
    replaced: str | None = None  # see NOTE [ Publishing the pack ]

    def headline(self) -> str:
        """One line: what was packed, where, how big, how fast."""
        return (
            f"packed {self.count} {self._what()} into {self.path} "
            f"({self.format}, store={self.store}, {human_size(self.size_bytes)}) "
            f"in {self.seconds:.{1 if self.seconds >= 1 else 2}f} s"  # a quick pack is not "0.0 s"
        )

    def _what(self) -> str:
        if not self.classes:  # a pack of any sample
            return "samples"
        return f"images of {len(self.classes)} classes"

    def __str__(self) -> str:
        lines = [
            f"removed {path}, left by packer process {pid} that no longer runs"
            for path, pid in self.removed_partials
        ]
        lines += [self.replaced] if self.replaced else []
        lines.append(self.headline())
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} unreadable:")
            lines += [f"  {where}: {reason}" for where, reason in self.skipped[:20]]
            if len(self.skipped) > 20:
                lines.append(f"  ... and {len(self.skipped) - 20} more")
        return "\n".join(lines)


def _is_image(path: str) -> bool:
    return path.lower().endswith(IMG_EXTENSIONS)


def scan_image_folder(root: str | os.PathLike) -> tuple[list[tuple[str, int]], list[str]]:
    """List the images of a folder in torchvision ``ImageFolder`` layout, in its order.

    Classes are the sorted names of the subfolders of ``root`` (symlinks count). Each class
    folder is walked recursively, following symlinks, in ``sorted(os.walk(...))`` order, names
    sorted within a folder; a file is an image when its name ends with one of
    :data:`IMG_EXTENSIONS`, in any case. The result equals ``ImageFolder(root).samples``.

    Args:
        root: the folder; ``~`` is expanded.

    Returns:
        ``(samples, classes)``: ``samples`` is a list of ``(path, label)``.

    Raises:
        FileNotFoundError: if ``root`` does not exist, has no class folder, or a class folder
            holds no image (as ImageFolder does).
        NotADirectoryError: if ``root`` is not a folder.
    """
    root = os.path.expanduser(os.fspath(root))
    if not os.path.exists(root):
        raise FileNotFoundError(f"{root}: no such folder")
    if not os.path.isdir(root):
        raise NotADirectoryError(f"{root}: not a folder")
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"{root}: no class folders (expected one subfolder per class)")
    samples: list[tuple[str, int]] = []
    empty = []
    for label, name in enumerate(classes):
        files = class_folder_files(os.path.join(root, name), _is_image)
        samples += [(path, label) for path in files]
        if not files:
            empty.append(name)
    if empty:
        raise FileNotFoundError(
            f"{root}: found no image file for the classes {', '.join(empty)} "
            f"(supported extensions are: {', '.join(IMG_EXTENSIONS)})"
        )
    return samples, classes


# --- encode: runs in the worker processes -----------------------------------------------------


# --- scan and write: run in the main process --------------------------------------------------


def _encode_all(
    encoder: Callable, items: Sequence, workers: int, seconds: float = IMAGE_SECONDS
) -> Iterator[Encoded]:
    """Yield ``encoder(item)`` for every item in order, in ``workers`` processes if > 0
    (see NOTE [ Per-image limits when packing ] in _pack_pool.py)."""
    if workers <= 0:
        yield from map(encoder, items)
        return
    yield from encode_in_workers(encoder, items, workers, _start_method(), seconds)


class _Job(NamedTuple):
    encoder: Callable[[Any], Encoded]
    items: Sequence
    name: Callable[[int], str]  # what item i is called in the skipped list
    classes: list[str]
    source: str
    parallel: bool  # False when the encoder cannot reach worker processes
    relative: Callable[[int], str] | None = None  # item i's path relative to SRC, if a file
    schema: dict | None = None  # a pack of any sample (formats/fields.py)


def _folder_job(root: str | os.PathLike, options: Options) -> _Job:
    samples, classes = scan_image_folder(root)
    source = os.path.abspath(os.path.expanduser(os.fspath(root)))
    root = os.path.expanduser(os.fspath(root))

    def relative(index: int) -> str:
        return os.path.relpath(samples[index][0], root)

    return _Job(
        FolderEncoder(options), samples, lambda i: samples[i][0], classes, source, True, relative
    )


def _dataset_job(
    dataset: Any, options: Options, classes: Sequence[str] | None, schema: Any = None
) -> _Job:
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"source must be an image folder or a map-style dataset, not {dataset!r}")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    # A dataset with classes holds (image, label) samples; see NOTE [ Samples of fields ].
    labelled = classes is not None or getattr(dataset, "classes", None) is not None
    if schema is not None or (not labelled and is_fields_sample(dataset[0])):
        return _fields_job(dataset, options, classes, schema)
    names = _dataset_classes(dataset, classes)
    parallel = _start_method() == "fork" or _picklable(dataset)
    encoder = DatasetEncoder(dataset, options, len(names))
    source = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    return _Job(encoder, range(len(dataset)), str, names, source, parallel)


# NOTE [ Samples of fields ]
# pack(dataset) writes a pack of (image, label) records when the samples are image-and-int
# pairs, or the dataset says it classifies (a `classes` attribute, or classes=): what
# ImageFolder-like datasets give, and what older fastloader read. Anything else (dicts, tuples
# of other lengths or kinds, or schema=) is a pack of any sample (format 4, formats/fields.py).
# Deciding needs sample 0, read once in this process.


def _fields_job(dataset: Any, options: Options, classes: Any, schema: Any) -> _Job:
    """A pack of any sample: the schema from sample 0 (NOTE [ Fields payload ] in fields.py)."""
    if classes is not None:
        raise ValueError("classes= is for (image, label) samples; this dataset's have fields")
    schema = infer_schema(dataset[0], schema)
    parallel = _start_method() == "fork" or _picklable(dataset)
    source = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    encoder = FieldsEncoder(dataset, options, schema)
    return _Job(encoder, range(len(dataset)), str, [], source, parallel, schema=schema)


def _shuffled(job: _Job, seed: int) -> _Job:
    """``job`` with its items in the order ``default_rng(seed).permutation`` draws."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"shuffle_seed must be a non-negative int, got {seed!r}")
    order = np.random.default_rng(seed).permutation(len(job.items)).tolist()
    items = [job.items[index] for index in order]
    relative = job.relative
    return job._replace(
        items=items,
        name=lambda i: job.name(order[i]),
        relative=None if relative is None else (lambda i: relative(order[i])),
    )


def _is_hdf5_file(source: str | os.PathLike) -> bool:
    path = os.path.expanduser(os.fspath(source))
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as file:
        return file.read(8) == b"\x89HDF\r\n\x1a\n"


def _dataset_classes(dataset: Any, classes: Sequence[str] | None) -> list[str]:
    """``classes``, else ``dataset.classes``, else ``"0"`` .. ``str(largest label)``.

    The last needs every label first: ``dataset.targets`` if it has them, else one more pass.
    """
    if classes is None:
        classes = getattr(dataset, "classes", None)
    if classes is not None:
        return [str(name) for name in classes]
    targets = getattr(dataset, "targets", None)
    if targets is None or len(targets) != len(dataset):
        targets = [dataset[index][1] for index in range(len(dataset))]
    labels = [check_label(label, index, None) for index, label in enumerate(targets)]
    return [str(label) for label in range(max(labels) + 1)]


def _start_method() -> str:
    """The start method workers will use, without fixing the global one as a side effect."""
    return (
        multiprocessing.get_start_method(allow_none=True)
        or (
            multiprocessing.get_all_start_methods()[0]  # the platform's default comes first
        )
    )


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def check_options(
    store: str = "encoded",
    quality: int = 90,
    max_side: int | None = None,
    short_side: int | None = None,
    format: str | None = None,
    workers: int | None = None,
    image_timeout: float = IMAGE_SECONDS,
) -> None:
    """Check ``pack``'s options before any work (``fastloader-pack`` checks its flags with it).

    Raises:
        ValueError: naming the first option that is out of range or does not fit the others.
    """
    if store not in STORE_MODES:
        raise ValueError(f"store must be one of {', '.join(STORE_MODES)}, got {store!r}")
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an int from 1 to 100, got {quality!r}")
    for name, value in (("max_side", max_side), ("short_side", short_side)):
        if value is not None and store == "encoded":
            raise ValueError(f"{name} needs store='raw' or 'jpeg' (encoded keeps the files)")
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    if not isinstance(image_timeout, (int, float)) or not image_timeout > 0:
        raise ValueError(f"image_timeout must be a positive number, got {image_timeout!r}")


def _target_format(target: Path, format: str | None, source: Any) -> str:
    """The format to write: ``format``, else from the suffix, with a message in user's words."""
    if target.is_dir():
        name = Path(os.fspath(source)).name if isinstance(source, (str, os.PathLike)) else ""
        example = target / f"{name or 'train'}.lmdb"
        raise IsADirectoryError(
            f"{target}: is a folder; DST is the pack file to write, e.g. {example}"
        )
    if format is None and not target.suffix:
        raise ValueError(
            f"{target}: no suffix to tell the format from: name the pack file "
            f"{target.name}.lmdb, {target.name}.h5 or {target.name}.hdf5, or choose the format"
        )
    return format or format_from_suffix(target)


def _check_target(target: Path, overwrite: bool) -> None:
    """Fail before any work if the pack cannot be written, or would replace a file unasked."""
    if target.exists() and not overwrite:
        raise FileExistsError(
            f"{target}: already exists (use --overwrite, or overwrite=True, to replace it)"
        )
    if not target.parent.exists():
        raise FileNotFoundError(f"{target.parent}: no such folder to write {target.name} in")
    if not target.parent.is_dir():
        raise NotADirectoryError(f"{target.parent}: not a folder")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{target.parent}: no permission to write {target.name} there")


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# NOTE [ Atomic packing ]
# The writer writes a hidden temporary file beside the target, `.NAME.partial-PID@HOST`, in the
# same folder so that the final rename is atomic within one file system (and never replaces
# a DST that appeared meanwhile unless asked: NOTE [ Publishing the pack ] in
# _pack_output.py). The rename happens only after the writer's close() succeeded and the
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
    started = time.perf_counter()
    check_options(store, quality, max_side, short_side, format, workers, image_timeout)
    target = Path(os.path.expanduser(os.fspath(path)))
    format = _target_format(target, format, source)
    _check_target(target, overwrite)
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
    options = Options(store, quality, max_side, short_side, check)
    if isinstance(source, (str, os.PathLike)) and _is_hdf5_file(source):
        from fastloader.formats.hdf5_foreign import HDF5File

        source = HDF5File(os.path.expanduser(os.fspath(source)))  # NOTE [ Samples of fields ]
    if isinstance(source, (str, os.PathLike)):
        if classes is not None:
            raise ValueError("classes= is for datasets: an image folder's classes are its folders")
        job = _folder_job(source, options)
    else:
        job = _dataset_job(source, options, classes, schema)
    if shuffle_seed is not None:
        job = _shuffled(job, shuffle_seed)
    if workers is None:
        # Quick-checking the files of a folder kept as they are (store="encoded") costs less
        # than sending them between processes: measured 1.6x faster in this process. The full
        # check decodes every image: that is worth the workers.
        keeps_files = store == "encoded" and isinstance(source, (str, os.PathLike))
        workers = 0 if keeps_files and check == "quick" else _default_workers()
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
    temp = partial_path(target)
    seen, free = file_identity(target), free_bytes(target.parent)
    writer = None
    try:
        writer = open_writer(temp, format, store=store, classes=job.classes, info=info)
        writer.schema = job.schema
        results = _encode_all(job.encoder, job.items, workers, image_timeout)
        show = sys.stderr.isatty() if progress is None else progress
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
