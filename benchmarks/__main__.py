"""``python -m benchmarks``: run every comparison, print a table, write JSON, Markdown and plots.

Usage::

    python -m benchmarks [--size tiny|quick|full] [--quick] [--out DIR] [--only NAME,...]
                         [--keep-work]

``quick`` (the default, also ``--quick``) is the demo: the training-pipeline comparison (the
headline), the transport table and the loader comparison (its duration: :func:`demo_duration`,
which the README repeats; the main process runs torch on one intra-op thread, see NOTE [ One
intra-op thread in the demo ]); ``full`` runs every comparison (under fifteen minutes);
``tiny`` every comparison in seconds (the smoke test).
Data is made under ``DIR/work`` and removed at the end unless ``--keep-work``. A comparison
that raises is recorded with its error and the others still run; the exit status is then 1.

While it runs, stderr shows one line of progress (the running comparison's bar, with the time
left estimated from this run's measured rates), erased at the end (lines instead when stderr is
not a terminal; see _progress.py).
At the end, stdout gets the summary: the training pipeline first, then the loader table and
each other comparison's ratios, the same numbers results.md opens with.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks import COMPARISONS, DEMO, SIZES, report
from benchmarks._progress import Pace, Stage
from benchmarks.plots import write_plots

# torch, NumPy and the photos come in with machine_info(), after the arguments are parsed, so
# that `--help` and usage errors answer at once (see NOTE [ Fast command start-up ] in
# fastloader/cli.py).

#: Seconds each comparison took on the 2-core box with nothing else running (rounded up). The
#: progress bars scale them by how much slower this run's finished stages were (Pace); a
#: comparison not listed shows its elapsed time until it plans its work (_progress.plan).
EXPECTED_SECONDS = {
    "tiny": {
        "cheap": 20,
        "loader": 10,
        "formats": 10,
        "packing": 10,
        "memory": 10,
        "cli_startup": 15,
        "mix": 20,
        "transport": 20,
        "remote": 30,
    },
    "quick": {"pipeline": 18, "loader": 18, "cheap": 120, "transport": 17, "threads": 100},
    "full": {
        "cheap": 300,
        "loader": 95,
        "formats": 170,
        "packing": 90,
        "memory": 35,
        "cli_startup": 120,
        "mix": 150,
        "transport": 400,
        "remote": 300,
    },
}


# NOTE [ One intra-op thread in the demo ]
# The demo's main process only consumes batches (and, without workers, makes them): its
# copies are torch's clone and stack, which torch splits over its intra-op (OpenMP) threads.
# On a busy 2-core machine one of those threads is often descheduled and every copy waits for
# it at the barrier: 3x224x224 images without workers took 1.2-15 s an epoch with 2 threads
# and 0.17 s with 1 (load 10, 1024 images, both loaders alike), and the in-process images
# row read 0.3-0.8x torch from that noise alone (0.96x with 1 thread). So the demo sets one
# intra-op thread, as fastloader's and torch's workers have; the other sizes keep torch's
# default (results.json's machine.main_process_torch_threads says which ran).


def _about(seconds: float) -> str:
    return f"about {max(seconds / 60, 1):.0f} min on 2 idle cores"


def demo_duration() -> str:
    """How long the demo takes, from EXPECTED_SECONDS: its header and the README say this."""
    return _about(sum(EXPECTED_SECONDS["quick"].get(name, 0) for name in DEMO))


def parse_args(
    argv: Sequence[str] | None, prog: str = "python -m benchmarks"
) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="fastloader vs torch's DataLoader (and packed formats vs image folders, "
        "and litdata) on the same data, in one run.",
    )
    parser.add_argument("--size", choices=SIZES, default="quick", help="default: quick")
    parser.add_argument(
        "--quick", action="store_const", const="quick", dest="size", help="same as --size quick"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="folder for results.json, results.md, *.png (default: %(default)s)",
    )
    parser.add_argument(
        "--only",
        help=f"comma-separated subset of {','.join(COMPARISONS)} (default: {','.join(DEMO)} "
        "at size quick, every one at the other sizes)",
    )
    parser.add_argument(
        "--keep-work", action="store_true", help="keep the generated photos and packs in OUT/work"
    )
    args = parser.parse_args(argv)
    if args.only is None:
        args.only = ",".join(DEMO if args.size == "quick" else COMPARISONS)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(COMPARISONS))
    if unknown or not args.only:
        parser.error(f"--only takes names from {','.join(COMPARISONS)}; got {args.only}")
    return args


def machine_info() -> dict:
    """What ran the suite: CPUs, platform, versions, date, and where the photos came from."""
    import numpy as np
    import torch

    from benchmarks._photos import source_photos

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "photos": source_photos()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # the box may be shared: what else ran at the start (1-minute load average)
        "load_average": round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None,
    }


def torch_threads() -> int:
    """The main process's torch intra-op threads (NOTE [ One intra-op thread in the demo ])."""
    import torch

    return torch.get_num_threads()


def run_comparison(name: str, size: str, workdir: Path) -> dict:
    """Run ``benchmarks.<name>.run(size, workdir)``; an exception becomes an ``error`` entry."""
    started = time.perf_counter()
    module = None
    try:
        module = importlib.import_module(f"benchmarks.{name}")
        result = dict(module.run(size, workdir))
    except Exception:  # noqa: BLE001 - one failing comparison must not hide the others
        result = {"rows": [], "ratios": {}, "error": traceback.format_exc()}
    result.setdefault("rows", [])
    result.setdefault("ratios", {})
    result.setdefault("skipped", None)
    result.pop("comparison", None)
    doc = (module.__doc__ or "").strip() if module is not None else ""
    summary = {"title": doc.splitlines()[0] if doc else name}
    return {**summary, **result, "seconds": round(time.perf_counter() - started, 1)}


def _start(args: argparse.Namespace) -> tuple[dict, Pace]:
    """The results' machine entry, the demo's thread setting, the header line; and the pace."""
    results = {"machine": machine_info(), "size": args.size, "comparisons": {}}
    if args.size == "quick":  # NOTE [ One intra-op thread in the demo ]
        import torch

        torch.set_num_threads(1)
    results["machine"]["main_process_torch_threads"] = torch_threads()
    load = results["machine"]["load_average"]
    busy = load is not None and load >= 1
    usual = sum(EXPECTED_SECONDS.get(args.size, {}).get(name, 0) for name in args.only)
    print(
        f"Running {len(args.only)} comparison{'s' if len(args.only) > 1 else ''} at size "
        f"{args.size} ({', '.join(args.only)}"
        + (f"; {_about(usual)}" if usual else "")
        + (f"; load average {load} now: longer" if busy else "")
        + f"); results go to {args.out}/",
        file=sys.stderr,
        flush=True,
    )
    return results, Pace(idle=not busy)


def _run_all(args: argparse.Namespace, results: dict, pace: Pace, workdir: Path) -> None:
    """Each comparison in turn, with its progress bar (or lines)."""
    expected = EXPECTED_SECONDS.get(args.size, {})
    bars = sys.stderr.isatty()
    for index, name in enumerate(args.only, 1):
        label = f"[{index}/{len(args.only)}] {name}"
        with Stage(label, pace.scale(expected.get(name)), bars) as stage:
            result = run_comparison(name, args.size, workdir)
            results["comparisons"][name] = result
            status = (
                f"skipped ({result['skipped']})"
                if result["skipped"]
                else "error (see the end)"
                if "error" in result
                else "done"
            )
            stage.finish(f"{status} in {result['seconds']:.0f} s")
            if status == "done":  # a skip or an error says nothing about the pace
                pace.record(expected.get(name), result["seconds"])


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """Run the suite; return 0, or 1 if a comparison raised."""
    args = parse_args(argv, prog)
    out = args.out
    workdir = out / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    results, pace = _start(args)
    started = time.perf_counter()
    try:
        _run_all(args, results, pace, workdir)
    finally:
        if not args.keep_work:
            shutil.rmtree(workdir, ignore_errors=True)
    results["seconds"] = round(time.perf_counter() - started, 1)
    if hasattr(os, "getloadavg"):
        results["machine"]["load_average_at_end"] = round(os.getloadavg()[0], 1)
    plots, plots_skipped = write_plots(results, out)
    results["plots"] = [plot.name for plot in plots]
    results["plots_skipped"] = plots_skipped
    printed = report.summary(results, out, plots)
    report.write_json(results, out / "results.json")
    (out / "results.md").write_text(report.render(results, markdown=True, printed=printed))
    print(printed)
    if plots_skipped:
        print(plots_skipped)
    errors = [name for name, result in results["comparisons"].items() if "error" in result]
    for name in errors:
        print(f"\n{name} failed:\n{results['comparisons'][name]['error']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
