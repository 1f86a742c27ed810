"""What to pack: an image folder scanned in ImageFolder's order, or a map-style dataset, as a job.

Runs in the packer's main process. A job is the items to encode, the encoder the workers run
on each, the classes, and how to name an item in a message (``pack.py`` runs the job).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from fastloader.packing.fields import FieldsEncoder, infer_schema, is_fields_sample
from fastloader.packing.options import start_method
from fastloader.packing.worker import DatasetEncoder, Encoded, FolderEncoder, Options, check_label
from fastloader.vision.images import IMG_EXTENSIONS, class_folder_files


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


class Job(NamedTuple):
    encoder: Callable[[Any], Encoded]
    items: Sequence
    name: Callable[[int], str]  # what item i is called in the skipped list
    classes: list[str]
    source: str
    parallel: bool  # False when the encoder cannot reach worker processes
    relative: Callable[[int], str] | None = None  # item i's path relative to SRC, if a file
    schema: dict | None = None  # a pack of any sample (formats/fields.py)


def folder_job(root: str | os.PathLike, options: Options) -> Job:
    samples, classes = scan_image_folder(root)
    source = os.path.abspath(os.path.expanduser(os.fspath(root)))
    root = os.path.expanduser(os.fspath(root))

    def relative(index: int) -> str:
        return os.path.relpath(samples[index][0], root)

    return Job(
        FolderEncoder(options), samples, lambda i: samples[i][0], classes, source, True, relative
    )


def dataset_job(
    dataset: Any, options: Options, classes: Sequence[str] | None, schema: Any = None
) -> Job:
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"source must be an image folder or a map-style dataset, not {dataset!r}")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    # A dataset with classes holds (image, label) samples; see NOTE [ Samples of fields ].
    labelled = classes is not None or getattr(dataset, "classes", None) is not None
    if schema is not None or (not labelled and is_fields_sample(dataset[0])):
        return _fields_job(dataset, options, classes, schema)
    names = _dataset_classes(dataset, classes)
    parallel = start_method() == "fork" or _picklable(dataset)
    encoder = DatasetEncoder(dataset, options, len(names))
    source = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    return Job(encoder, range(len(dataset)), str, names, source, parallel)


def _fields_job(dataset: Any, options: Options, classes: Any, schema: Any) -> Job:
    """A pack of any sample: the schema from sample 0 (NOTE [ Fields payload ] in fields.py)."""
    if classes is not None:
        raise ValueError("classes= is for (image, label) samples; this dataset's have fields")
    schema = infer_schema(dataset[0], schema)
    parallel = start_method() == "fork" or _picklable(dataset)
    source = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    encoder = FieldsEncoder(dataset, options, schema)
    return Job(encoder, range(len(dataset)), str, [], source, parallel, schema=schema)


def shuffled(job: Job, seed: int) -> Job:
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


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
