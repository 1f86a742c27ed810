"""Command start-up: how long ``fastloader-pack`` takes to answer, and to pack a small folder.

Each command runs as a fresh process (``python -m fastloader.cli ...``, what the console script
runs), the commands taking turns for ``runs`` rounds; the table gives the median wall time of
each. ``python -c pass`` is the interpreter's own start-up, the floor for any command. For the
pack, the wall time is split into the packing work (the time ``pack()`` reports) and the rest:
imports, process start and exit. ``pack, no fast exit`` runs the same pack with the final
garbage collection left on (see NOTE [ Fast exit ] in fastloader/cli.py).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._photos import make_image_folder
from benchmarks._progress import note

# size -> (rounds, images in the folder packed)
SIZES = {"tiny": (1, 8), "quick": (3, 32), "full": (11, 256)}
ROOT = Path(__file__).resolve().parents[1]
_NO_FAST_EXIT = "import sys; from fastloader.cli import main; sys.exit(main(sys.argv[1:]))"
_WORK = re.compile(r" in (\d+(?:\.\d+)?) s$")


def _commands(folder: Path, pack: Path, target: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "fastloader.cli"]
    packing = [str(folder), str(target), "--store", "raw", "--short-side", "224", "--overwrite"]
    return {
        "python -c pass (interpreter start)": [sys.executable, "-c", "pass"],
        "fastloader-pack --help": [*cli, "--help"],
        "fastloader-pack SRC (usage error)": [*cli, str(folder)],
        "fastloader-pack --info PACK": [*cli, "--info", str(pack)],
        "fastloader-pack SRC DST --store raw": [*cli, *packing],
        "pack, no fast exit": [sys.executable, "-c", _NO_FAST_EXIT, *packing],
    }


def _run_once(argv: list[str], env: dict) -> tuple[float, float | None]:
    """Wall seconds of one run, and the packing work it reports (None if not a pack)."""
    started = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    wall = time.perf_counter() - started
    if run.returncode not in (0, 2):
        raise RuntimeError(f"{' '.join(argv)} failed ({run.returncode}):\n{run.stderr}")
    lines = run.stdout.splitlines()
    match = _WORK.search(lines[0]) if lines and lines[0].startswith("packed ") else None
    return wall, float(match[1]) if match else None


def run(size: str, workdir: Path) -> dict:
    """Run the start-up comparison at ``size`` ("tiny", "quick", "full")."""
    rounds, images = SIZES[size]
    folder = make_image_folder(workdir / f"cli_photos_{images}", images)
    pack = workdir / "cli_startup_info.lmdb"
    target = workdir / "cli_startup_out.lmdb"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, "-m", "fastloader.cli", str(folder), str(pack), "--overwrite", "-q"],
        check=True,
        env=env,
        timeout=300,
    )
    commands = _commands(folder, pack, target)
    walls: dict[str, list[float]] = {name: [] for name in commands}
    works: dict[str, list[float]] = {name: [] for name in commands}
    for round_ in range(rounds):
        note(f"round {round_ + 1} of {rounds}")
        for name, argv in commands.items():
            wall, work = _run_once(argv, env)
            walls[name].append(wall)
            if work is not None:
                works[name].append(work)
    rows = []
    for name in commands:
        row = {"command": name, "median_ms": round(statistics.median(walls[name]) * 1e3, 1)}
        if works[name]:
            work = statistics.median(works[name])
            row["pack_work_ms"] = round(work * 1e3, 1)
            row["rest_ms"] = round(statistics.median(walls[name]) * 1e3 - work * 1e3, 1)
        rows.append(row)
    median = {name: statistics.median(values) for name, values in walls.items()}
    pack_name, slow_name = "fastloader-pack SRC DST --store raw", "pack, no fast exit"
    return {
        "config": {"rounds": rounds, "images": images, "python": sys.executable},
        "rows": rows,
        "ratios": {
            "help_over_interpreter_start": median["fastloader-pack --help"]
            / median["python -c pass (interpreter start)"],
            "fast_exit_speedup_of_pack": median[slow_name] / median[pack_name],
        },
        "notes": [
            f"median of {rounds} runs per command, the commands taking turns; "
            f"the pack is {images} photos stored raw at short side 224, 1 process per CPU",
            "rest_ms: wall time not spent packing (interpreter start, imports, exit)",
        ],
    }
