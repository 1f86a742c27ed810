"""The console commands: argument parsing only; the work is in the library.

``fastloader-pack`` (packing, as it always was)::

    fastloader-pack SRC DST [--format lmdb|hdf5] [--store encoded|raw|jpeg] [--quality Q]
                    [--max-side N] [--short-side N] [--workers N] [--check full|quick]
                    [--layout columns|records] [--overwrite] [--strict] [--quiet]
    fastloader-pack --info PACK
    fastloader-pack --verify PACK

``fastloader`` (the same, as subcommands, plus the benchmark demo)::

    fastloader pack SRC DST [options]     fastloader info PACK
    fastloader verify PACK [--quiet]      fastloader bench [--quick | --size full ...]

See NOTE [ Fast command start-up ] for why nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# NOTE [ Fast command start-up ]
# `--help` and usage errors must answer at once, and torch alone takes seconds to import on a
# loaded machine. So this module imports only the standard library; torch, NumPy, PIL, h5py and
# lmdb come in with the library module a command calls (fastloader.pack for packing,
# fastloader.formats for --info and --verify), inside the function that runs that command; and
# those import no torch either (NOTE [ Torch-free pack files ] in formats/__init__.py), unless a
# dataset is packed. fastloader's __init__ is lazy for the same reason (see
# NOTE [ Lazy public API ] in __init__.py). The choices below repeat fastloader.formats.FORMATS /
# STORE_MODES (tests/test_cli.py checks they agree). benchmarks/cli_startup.py measures the
# commands' start-up.

# NOTE [ Fast exit ]
# Once torch is imported, the interpreter's final garbage collections walk its millions of
# objects: measured 0.8-1.8 s of exit on the shared 2-core box, after a pack that took 2 s.
# Run as a program (argv=None: a console script or `python -m`), a command ends with
# gc.freeze(), which moves every object out of the collector's reach: exit then took ~0.25 s.
# atexit handlers and finalizers still run; nothing is skipped but the walk over live
# objects. Called from Python with an argv list (tests, other tools), nothing is frozen.


def _finish(code: int, argv: Sequence[str] | None) -> int:
    if argv is None:
        gc.freeze()  # see NOTE [ Fast exit ]
    return code


# NOTE [ A closed pipe ]
# `fastloader-pack --info X | head` closes the pipe once `head` has its lines. Python ignores
# SIGPIPE, so the next write (or the flush at exit) raises BrokenPipeError, which is an
# OSError: it was reported as "error: [Errno 32] Broken pipe", exit 1. A reader that stops
# reading is not an error: the command stops quietly with 141 (128 + SIGPIPE, what `cat`
# gives in a pipeline with `pipefail`), its stdout pointed at /dev/null so that the
# interpreter's final flush does not raise again.
EXIT_BROKEN_PIPE = 141


def _quiet_on_broken_pipe(run: Callable[[], int]) -> int:
    """``run()``, its stdout flushed; a closed pipe on stdout ends it quietly (NOTE [ A closed
    pipe ])."""
    try:
        code = run()
        sys.stdout.flush()  # the output is buffered in a pipe: a closed one shows here
        return code
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no file descriptor (stdout replaced from Python)
            pass
        return EXIT_BROKEN_PIPE


PROG = "fastloader-pack"
FORMAT_CHOICES = ("lmdb", "hdf5")
STORE_CHOICES = ("encoded", "raw", "jpeg")
CHECK_CHOICES = ("full", "quick")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """Return the argument parser of ``fastloader-pack`` (``fastloader pack`` when ``prog``)."""
    subcommand = prog != PROG
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Pack an image folder (torchvision ImageFolder layout: one subfolder per "
        "class) into one LMDB or HDF5 file for fastloader.LMDBDataset / HDF5Dataset.",
    )
    if not subcommand:
        parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument(
        "src",
        nargs="?",
        metavar="SRC",
        help="the image folder, or an HDF5 file of aligned datasets (one sample per row)",
    )
    parser.add_argument(
        "dst", nargs="?", metavar="DST", help="the pack file to write: NAME.lmdb, .h5 or .hdf5"
    )
    if not subcommand:
        parser.add_argument("--info", metavar="PACK", help="print what a pack holds, and exit")
        parser.add_argument(
            "--verify",
            metavar="PACK",
            help="read and check every record of a pack, and exit (0: clean, 1: bad records, "
            "2: unreadable)",
        )
    parser.add_argument(
        "--format",
        choices=FORMAT_CHOICES,
        help="default: from DST's suffix (.lmdb, .h5, .hdf5); hdf5 needs about twice the pack's "
        "size free on DST's disk while packing (its records are spooled, then copied)",
    )
    parser.add_argument(
        "--store",
        choices=STORE_CHOICES,
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
        help="decoding processes (default: all usable CPUs; none for --store encoded with "
        "--check quick, whose files are only checked)",
    )
    parser.add_argument(
        "--check",
        choices=CHECK_CHOICES,
        help="how each input image is checked before it is packed: full (decode it all; the "
        "default) or quick (headers and end markers only: faster, weaker)",
    )
    parser.add_argument(
        "--image-timeout",
        type=float,
        metavar="SECONDS",
        help="skip an image that takes longer to decode in a worker process (default 120)",
    )
    parser.add_argument(
        "--fields",
        metavar="A,B",
        help="for an HDF5 SRC: the datasets to pack, by path (default: every top-level one)",
    )
    parser.add_argument(
        "--image-field",
        action="append",
        metavar="NAME",
        help="for an HDF5 SRC: a uint8 (N,H,W[,C]) dataset to store as images (with --store; "
        "repeat for several)",
    )
    parser.add_argument(
        "--layout",
        metavar="LAYOUT",
        help="for an HDF5 SRC (samples of many fields): columns (the default: whole batches "
        "read by column, format 5) or records (one record per sample, format 4, which earlier "
        "releases read); checked as pack(layout=) checks it",
    )
    parser.add_argument(
        "--shuffle-seed",
        type=int,
        metavar="N",
        help="write the samples in an order shuffled by seed N (for BlockShuffleSampler on slow "
        "storage) instead of ImageFolder's",
    )
    parser.add_argument(
        "--shard-size",
        metavar="SIZE",
        help="write a sharded pack: DST is a folder or s3://bucket/prefix of packs of about "
        "SIZE each (64MB, 1GiB) plus a manifest written last (docs/remote.md)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument(
        "--strict", action="store_true", help="fail on the first unreadable image (else skip it)"
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary; skipped files are still listed on stderr",
    )
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if _inspects(parser, args):
        return args
    if args.dst is None:
        parser.error(
            "SRC and DST are required (or --info PACK)"
            if hasattr(args, "info")
            else "SRC and DST are required"
        )
    _check_pack_options(parser, args)
    if (args.fields or args.image_field or args.layout) and (
        args.src is None or os.path.isdir(args.src)
    ):
        parser.error("--fields, --image-field and --layout apply to an HDF5 file SRC")
    return args


def _inspects(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether the command is ``--info`` or ``--verify`` (checked: the pack alone)."""
    for flag in ("info", "verify"):
        if getattr(args, flag, None) is not None:
            if args.src is not None or args.dst is not None:
                parser.error(f"--{flag} takes only the pack, no SRC or DST")
            other = "verify" if flag == "info" else "info"
            if getattr(args, other, None) is not None:
                parser.error("use --info or --verify, not both")
            return True
    return False


def _check_pack_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The packing options, by the library's checks, reported in the flags' words."""
    if args.quality is not None and args.store != "jpeg":
        parser.error("--quality applies to --store jpeg")
    from fastloader.packing.options import check_options  # the library's checks (no torch)

    try:
        given = {"quality": args.quality, "image_timeout": args.image_timeout}
        given["layout"] = args.layout  # its choices: pack()'s own (LAYOUTS, no copy here)
        check_options(
            args.store,
            max_side=args.max_side,
            short_side=args.short_side,
            format=args.format,
            workers=args.workers,
            **{name: value for name, value in given.items() if value is not None},
        )
    except ValueError as error:  # in the flags' words: "--short-side must be ..."
        parser.error("--" + str(error).replace("_", "-"))


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return " ".join(str(error).split()) or type(error).__name__


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Failures that get a one-line message and exit status 1, no traceback.

    OSError covers the file errors: FileNotFoundError, FileExistsError, PermissionError, ...;
    lmdb.Error what LMDB raises for them (its errors are no OSError).
    """
    import lmdb

    from fastloader.formats import PackError

    return (PackError, ValueError, OSError, lmdb.Error, ImportError)  # ImportError: an extra


def _run_pack(args: argparse.Namespace, prog: str) -> int:
    from fastloader.packing import pack
    from fastloader.packing.process import Terminated, signals_as_interrupts

    with signals_as_interrupts():  # see NOTE [ Signals while packing ]
        try:
            extra = _given_options(args)
            source, schema = _source(args)
            if schema is not None:
                extra["schema"] = schema
            summary = pack(
                source,
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
                **extra,
            )
        except Terminated:
            print(f"{prog}: terminated (SIGTERM)", file=sys.stderr)
            return EXIT_TERMINATED
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except _expected_errors() as error:
            print(f"{prog}: error: {_one_line(error)}", file=sys.stderr)
            return 1
    if not args.quiet:
        for path, pid in summary.removed_partials:
            print(
                f"{prog}: removed {path}, left by packer process {pid} that no longer runs",
                file=sys.stderr,
            )
        print(summary.headline())
        if summary.skipped:
            print(f"skipped {len(summary.skipped)} unreadable images, listed on stderr")
    replaced = getattr(summary, "replaced", None)
    if replaced:  # never silenced either: see NOTE [ Publishing the pack ]
        print(f"{prog}: {replaced}", file=sys.stderr)
    # The skipped files are never silenced: a user must know what is missing from the pack.
    for where, reason in summary.skipped:
        print(f"{prog}: skipped {where}: {reason}", file=sys.stderr)
    return 0


def _given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``pack()`` the user gave (the others keep ``pack()``'s defaults)."""
    given = {
        "check": args.check,
        "image_timeout": args.image_timeout,
        "shuffle_seed": args.shuffle_seed,
        "shard_size": args.shard_size,
        "layout": args.layout,
    }
    return {name: value for name, value in given.items() if value is not None}


def _source(args: argparse.Namespace) -> tuple[Any, dict | None]:
    """What to pack: the folder, or a user's HDF5 file as a dataset of dict samples, with the
    schema naming its image fields (docs/any-sample.md). Torch is not imported either way."""
    src = args.src
    if os.path.isdir(src) or not os.path.isfile(src):
        return src, None  # a folder (pack() reports a missing one)
    from fastloader.formats.signatures import is_hdf5_file

    if not is_hdf5_file(src):
        raise ValueError(f"{src}: SRC must be an image folder or an HDF5 file")
    from fastloader.formats.hdf5_foreign import HDF5File

    fields = [name for name in args.fields.split(",") if name] if args.fields else None
    images = list(args.image_field or [])
    if fields is not None:
        fields += [name for name in images if name not in fields]
    dataset = HDF5File(src, fields)
    missing = [name for name in images if name not in dataset.field_names]
    if missing:
        raise ValueError(f"{src}: --image-field {missing[0]}: no such dataset in the file")
    return dataset, {name: "image" for name in images}


def _run_info(path: str, prog: str) -> int:
    from fastloader.formats.info import describe
    from fastloader.shards.inspect import describe_sharded, is_sharded

    try:
        print((describe_sharded if is_sharded(path) else describe)(path))
    except BrokenPipeError:
        raise  # not the pack's error: NOTE [ A closed pipe ]
    except _expected_errors() as error:
        print(f"{prog}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    return 0


def _run_verify(path: str, quiet: bool, prog: str) -> int:
    """Run ``fastloader.formats.verify.run_cli``: 0 clean, 1 bad records, 2 unreadable."""
    from fastloader.formats.verify import run_cli
    from fastloader.shards.inspect import is_sharded, run_verify

    try:
        if is_sharded(path):
            return run_verify(path, quiet, prog)
        return run_cli(path, quiet=quiet, prog=prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _usage_exit(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Any:
    """``_parse``, or the exit status of --help (0) or of a usage error (2)."""
    try:
        return _parse(parser, argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fastloader-pack``.

    Args:
        argv: the arguments, without the program name; default ``sys.argv[1:]``.

    Returns:
        the exit status: 0 on success, 1 for an error (one line on stderr), 2 for a usage
        error, 130 when interrupted (Ctrl-C), 143 when terminated (SIGTERM), 141 when stdout
        is a pipe its reader closed (nothing printed; NOTE [ A closed pipe ]). An interrupted,
        terminated or failed run leaves no output file. ``--verify``: see ``fastloader verify``.
    """
    args = _usage_exit(build_parser(), argv)
    if isinstance(args, int):
        return args
    if args.info is not None:
        code = _quiet_on_broken_pipe(lambda: _run_info(args.info, PROG))
    elif args.verify is not None:
        code = _quiet_on_broken_pipe(lambda: _run_verify(args.verify, args.quiet, PROG))
    else:
        code = _quiet_on_broken_pipe(lambda: _run_pack(args, PROG))
    return _finish(code, argv)


# --- `fastloader`: the same commands as subcommands -------------------------------------------

_COMMANDS = {
    "pack": "pack an image folder into one LMDB or HDF5 file (as fastloader-pack)",
    "info": "print what a pack holds",
    "verify": "read and check every record of a pack (exit 0 clean, 1 bad records, 2 unreadable)",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastloader",
        description="fastloader's command line: pack image folders, inspect and verify packs "
        "(the benchmark demo is `python -m benchmarks`, in a clone of the repository). "
        "`fastloader COMMAND --help` for each command's options.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in _COMMANDS.items():
        commands.add_parser(name, help=help_text)
    return parser


def _pack_parser_for(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"fastloader {name}", description=_COMMANDS[name])
    parser.add_argument("pack", metavar="PACK", help="a .lmdb, .h5 or .hdf5 pack")
    if name == "verify":
        parser.add_argument(
            "-q", "--quiet", action="store_true", help="print only what is wrong, if anything"
        )
    return parser


def version_line() -> str:
    """What ``--version`` prints: ``fastloader 0.1.0`` (no torch imported)."""
    from fastloader import __version__

    return f"fastloader {__version__}"


def fastloader_main(argv: Sequence[str] | None = None) -> int:
    """Run ``fastloader COMMAND ...``; returns the command's exit status (2: usage error)."""
    code = _quiet_on_broken_pipe(lambda: _fastloader(list(sys.argv[1:] if argv is None else argv)))
    return _finish(code, argv)


def _fastloader(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "pack":
        prog = "fastloader pack"
        args = _usage_exit(build_parser(prog), rest)
        return args if isinstance(args, int) else _run_pack(args, prog)
    if command in ("info", "verify"):
        try:
            args = _pack_parser_for(command).parse_args(rest)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else 2
        prog = f"fastloader {command}"
        if command == "info":
            return _run_info(args.pack, prog)
        return _run_verify(args.pack, args.quiet, prog)
    parser = _top_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        parser.parse_args(argv)  # --help: 0; anything else is not a command: 2
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
