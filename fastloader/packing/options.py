"""Checking ``pack()``'s options before any work: one check, used by ``pack()`` and by the CLI.

Runs in the packer's main process (no torch). ``fastloader-pack`` checks its flags with
``check_options``, so a usage error reads the same from Python and from the shell.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

from fastloader.formats import FORMATS, LAYOUTS, STORE_MODES, format_from_suffix
from fastloader.packing.pool import IMAGE_SECONDS


def start_method() -> str:
    """The start method workers will use, without fixing the global one as a side effect."""
    return (
        multiprocessing.get_start_method(allow_none=True)
        or (
            multiprocessing.get_all_start_methods()[0]  # the platform's default comes first
        )
    )


def check_options(
    store: str = "encoded",
    quality: int = 90,
    max_side: int | None = None,
    short_side: int | None = None,
    format: str | None = None,
    workers: int | None = None,
    image_timeout: float = IMAGE_SECONDS,
    layout: str = LAYOUTS[0],
) -> None:
    """Check ``pack``'s options before any work (``fastloader-pack`` checks its flags with it).

    Raises:
        ValueError: naming the first option that is out of range or does not fit the others.
    """
    if store not in STORE_MODES:
        raise ValueError(f"store must be one of {', '.join(STORE_MODES)}, got {store!r}")
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an int from 1 to 100, got {quality!r}")
    for name, value in (("max_side", max_side), ("short_side", short_side)):
        _check_side(name, value, store)
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    if not isinstance(image_timeout, (int, float)) or not image_timeout > 0:
        raise ValueError(f"image_timeout must be a positive number, got {image_timeout!r}")


def _check_side(name: str, value: int | None, store: str) -> None:
    if value is None:
        return
    if store == "encoded":
        raise ValueError(f"{name} needs store='raw' or 'jpeg' (encoded keeps the files)")
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def target_format(target: Path, format: str | None, source: Any) -> str:
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


def check_target(target: Path, overwrite: bool) -> None:
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


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
