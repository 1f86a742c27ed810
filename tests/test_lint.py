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
