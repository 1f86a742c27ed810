"""The code keeps to its lint, format and complexity rules (pyproject.toml's [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command", [["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]]
)
def test_ruff_finds_nothing(command):
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


#: The most complex a function may be, by radon's count (ruff's mccabe counts boolean operators
#: differently and misses some): every function of fastloader/ keeps to it.
MAX_COMPLEXITY = 15


def test_every_function_is_at_most_complexity_15_by_radon():
    complexity = pytest.importorskip(
        "radon.complexity", reason="radon is in the test extra: pip install -e '.[test]'"
    )
    from radon.visitors import Function  # after the skip: radon is optional

    offenders = []
    for path in sorted((REPO / "fastloader").rglob("*.py")):
        for block in complexity.cc_visit(path.read_text(encoding="utf-8")):
            # functions and methods (a class's own figure is an average of its methods')
            if isinstance(block, Function) and block.complexity > MAX_COMPLEXITY:
                where = path.relative_to(REPO).as_posix()
                offenders.append(f"{where}:{block.lineno} {block.fullname} ({block.complexity})")
    assert not offenders, (
        f"{len(offenders)} functions over complexity {MAX_COMPLEXITY} (radon cc); split them into "
        "named steps:\n" + "\n".join(offenders)
    )
