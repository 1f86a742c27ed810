"""The examples run as a user runs them (a subprocess, CPU, tiny generated data), and the
README's Python blocks are excerpts of them, so what the README shows is what CI runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- example: (?P<path>\S+) -->\s*\n```python\n(?P<code>.*?)```", re.S)


def _run(args: list[str], tmp_path: Path, timeout: float = 180) -> str:
    """Run ``args`` in ``tmp_path`` (its own tiny data there); return stdout, or fail with both
    streams."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp_path),  # the examples' generated data goes under it
    }
    done = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _example(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / name), *args]


def test_train_folder_trains_on_cpu(tmp_path: Path) -> None:
    out = _run(_example("train_folder.py", "--device", "cpu"), tmp_path)
    assert "epoch 0: loss" in out and "epoch 1: loss" in out
    assert "input-bound" in out or "not input-bound" in out  # loader.stats.summary()


def test_train_folder_resumes_at_the_next_sample(tmp_path: Path) -> None:
    out = _run(_example("train_folder.py", "--device", "cpu", "--stop-after", "4"), tmp_path)
    assert "stopped after step 4 (epoch 1)" in out
    out = _run(_example("train_folder.py", "--device", "cpu", "--resume"), tmp_path)
    assert "resumed at step 4, epoch 1" in out
    assert "epoch 1: loss" in out and "step 6" in out  # the rest of epoch 1: 2 more steps


def test_train_folder_from_a_pack(tmp_path: Path) -> None:
    out = _run(_example("train_folder.py", "--device", "cpu", "--pack", "train.lmdb"), tmp_path)
    assert (tmp_path / "train.lmdb").exists() and "epoch 1: loss" in out


@pytest.mark.parametrize("packed", [False, True], ids=["in-place", "packed"])
def test_train_pose_reads_an_hdf5_file_in_place_and_packed(tmp_path: Path, packed: bool) -> None:
    args = ["--device", "cpu"] + (["--pack", "pose.lmdb"] if packed else [])
    out = _run(_example("train_pose.py", *args), tmp_path)
    assert "epoch 0: loss" in out and "epoch 1: loss" in out
    assert (tmp_path / "pose.lmdb").exists() == packed


@pytest.mark.slow
@pytest.mark.lightning
@pytest.mark.parametrize("packed", [False, True], ids=["datamodule", "packed"])
def test_train_lightning(tmp_path: Path, packed: bool) -> None:
    pytest.importorskip("lightning")
    args = ["--device", "cpu"] + (["--packed"] if packed else [])
    out = _run(_example("train_lightning.py", *args), tmp_path)
    assert "done: 2 epochs" in out and "val_accuracy" in out


@pytest.mark.slow
def test_train_ddp_with_torchrun_on_two_cpu_processes(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    args = ["--device", "cpu", "--checkpoint", str(tmp_path / "ddp.pt")]
    out = _run(torchrun + [str(EXAMPLES / "train_ddp.py"), *args], tmp_path, timeout=300)
    assert "epoch 1: loss" in out
    assert "evaluated 48 samples once each" in out  # every sample on exactly one rank


def _code_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _is_excerpt(block: str, source: str) -> bool:
    """Whether ``block``'s lines appear in ``source`` in order; a ``...`` line skips lines,
    otherwise lines are consecutive (blank lines and indentation ignored)."""
    lines = _code_lines(source)
    start = 0
    for chunk in re.split(r"^\s*(?:#\s*)?\.\.\.\s*$", block, flags=re.M):
        wanted = _code_lines(chunk)
        if not wanted:
            continue
        found = next(
            (
                at
                for at in range(start, len(lines) - len(wanted) + 1)
                if lines[at : at + len(wanted)] == wanted
            ),
            None,
        )
        if found is None:
            return False
        start = found + len(wanted)
    return True


def test_readme_python_blocks_are_excerpts_of_the_examples() -> None:
    readme = README.read_text()
    blocks = MARKER.findall(readme)
    assert len(blocks) == readme.count("```python"), (
        "every ```python block in README.md needs an `<!-- example: examples/FILE.py -->` "
        "line just before it"
    )
    for path, code in blocks:
        source = (ROOT / path).read_text()
        assert _is_excerpt(code, source), f"README block is not an excerpt of {path}:\n{code}"


def test_excerpt_check_catches_a_changed_line() -> None:
    source = "a = 1\nb = 2\n\nc = 3\nd = 4\n"
    assert _is_excerpt("a = 1\nb = 2\nc = 3\n", source)
    assert _is_excerpt("a = 1\n...\nd = 4\n", source)
    assert not _is_excerpt("a = 1\nc = 3\n", source)  # a line left out needs a `...`
    assert not _is_excerpt("a = 1\nb = 3\n", source)


def test_every_example_is_tested() -> None:
    tested = set(re.findall(r'"(\w+\.py)"', Path(__file__).read_text()))
    examples = {path.name for path in EXAMPLES.glob("*.py") if not path.name.startswith("_")}
    assert examples <= tested, f"examples without a test: {sorted(examples - tested)}"


def _mixed_order(prefix: Path, ranks: int) -> list:
    """(epoch, source, index) in global order from train_mix.py's identity logs."""
    steps: dict = {}
    for rank in range(ranks):
        for line in Path(f"{prefix}.rank{rank}").read_text().splitlines():
            epoch, position, rows = json.loads(line)
            steps.setdefault((epoch, position), {})[rank] = rows
    return [
        (epoch, source, index)
        for (epoch, _), by_rank in sorted(steps.items())
        for rank in sorted(by_rank)
        for source, index in by_rank[rank]
    ]


def test_train_mix_resumed_on_three_ranks_reads_what_two_ranks_would(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
    script = str(EXAMPLES / "train_mix.py")
    common = ["--data", str(tmp_path / "tokens"), "--checkpoint", str(tmp_path / "mix.pt")]
    clean = _run([*torchrun, "2", script, *common, "--log-identities", "clean"], tmp_path, 300)
    assert "epoch 1: loss" in clean and "sources code" in clean
    out = _run(
        [*torchrun, "2", script, *common, "--stop-after", "6", "--log-identities", "cut"],
        tmp_path,
        300,
    )
    assert "stopped after step 6" in out
    out = _run(
        [*torchrun, "3", script, *common, "--resume", "--workers", "0", "--batch-size", "6"]
        + ["--log-identities", "cut"],
        tmp_path,
        300,
    )
    assert "resumed at step 6, epoch 0, sample 96 of the epoch" in out
    stitched = _mixed_order(tmp_path / "cut", 3)
    assert stitched == _mixed_order(tmp_path / "clean", 2)  # the same samples, same order
