"""``fastloader-pack``: argument parsing only; the work is :func:`fastloader.pack.pack`.

Usage::

    fastloader-pack SRC DST [--format lmdb|hdf5] [--store encoded|raw|jpeg] [--quality Q]
                    [--max-side N] [--short-side N] [--workers N] [--overwrite] [--strict]
                    [--quiet]
    fastloader-pack --info PACK
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from fastloader.formats import FORMATS, STORE_MODES, PackError, read_metadata
from fastloader.pack import human_size, pack

PROG = "fastloader-pack"
# Expected failures: a one-line message and exit status 1, no traceback. (OSError covers the
# file errors: FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, ...)
_EXPECTED = (PackError, ValueError, OSError)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``fastloader-pack``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Pack an image folder (torchvision ImageFolder layout: one subfolder per "
        "class) into one LMDB or HDF5 file for fastloader.LMDBDataset / HDF5Dataset.",
    )
    parser.add_argument("src", nargs="?", metavar="SRC", help="the image folder")
    parser.add_argument("dst", nargs="?", metavar="DST", help="the pack: .lmdb, .h5 or .hdf5")
    parser.add_argument("--info", metavar="PACK", help="print what a pack holds, and exit")
    parser.add_argument(
        "--format", choices=tuple(FORMATS), help="default: from DST's suffix (.lmdb, .h5, .hdf5)"
    )
    parser.add_argument(
        "--store",
        choices=STORE_MODES,
        default="encoded",
        help="encoded: the files' bytes (default); raw: decoded RGB pixels; jpeg: re-encoded",
    )
    parser.add_argument(
        "--quality", type=int, metavar="Q", help="JPEG quality for --store jpeg (default 90)"
    )
    parser.add_argument(
        "--max-side",
        type=int,
        metavar="N",
        help="with --store raw/jpeg: shrink images so the longer side is at most N",
    )
    parser.add_argument(
        "--short-side",
        type=int,
        metavar="N",
        help="with --store raw/jpeg: shrink images so the shorter side is at most N",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="decoding processes (default: all usable CPUs; none for --store encoded, whose "
        "files are only checked)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument(
        "--strict", action="store_true", help="fail on the first unreadable image (else skip it)"
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no summary on success"
    )
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.info is not None:
        if args.src is not None or args.dst is not None:
            parser.error("--info takes only the pack to describe")
        return args
    if args.dst is None:
        parser.error("SRC and DST are required (or --info PACK)")
    if args.quality is not None and args.store != "jpeg":
        parser.error("--quality applies to --store jpeg")
    if args.quality is not None and not 1 <= args.quality <= 100:
        parser.error("--quality must be from 1 to 100")
    for flag, value in (("--max-side", args.max_side), ("--short-side", args.short_side)):
        if value is not None and args.store == "encoded":
            parser.error(f"{flag} applies to --store raw or jpeg (encoded keeps the files)")
        if value is not None and value < 1:
            parser.error(f"{flag} must be a positive number of pixels")
    if args.workers is not None and args.workers < 0:
        parser.error("--workers must be 0 or more")
    return args


def describe(path: str) -> str:
    """Return a short description of the pack at ``path`` (what ``--info`` prints).

    Args:
        path: a pack written by ``fastloader-pack`` (either format).

    Raises:
        PackError: if the file is not a complete fastloader pack.
        FileNotFoundError: if it does not exist.
    """
    metadata = read_metadata(path)
    classes = metadata["classes"]
    names = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
    info = metadata.get("info") or {}
    lines = [
        f"path:     {path}",
        f"backend:  {metadata['backend']} (format version {metadata['version']})",
        f"store:    {metadata['store']}",
        f"count:    {metadata['count']}",
        f"classes:  {len(classes)}" + (f" ({names})" if classes else ""),
        f"size:     {human_size(os.path.getsize(path))}",
    ]
    if info:
        lines.append("info:")
        lines += [f"  {key}: {value}" for key, value in sorted(info.items())]
    return "\n".join(lines)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fastloader-pack``.

    Args:
        argv: the arguments, without the program name; default ``sys.argv[1:]``.

    Returns:
        the exit status: 0 on success, 1 for an error (one line on stderr), 2 for a usage
        error, 130 when interrupted. An interrupted or failed run leaves no output file.
    """
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        if args.info is not None:
            print(describe(args.info))
            return 0
        summary = pack(
            args.src,
            args.dst,
            format=args.format,
            store=args.store,
            quality=90 if args.quality is None else args.quality,
            max_side=args.max_side,
            short_side=args.short_side,
            workers=args.workers,
            overwrite=args.overwrite,
            strict=args.strict,
            progress=False if args.quiet else None,
        )
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except _EXPECTED as error:
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(summary)
    elif summary.skipped:
        print(f"{PROG}: skipped {len(summary.skipped)} unreadable images", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
