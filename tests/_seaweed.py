"""The S3 test server (benchmarks/_seaweed.py: SeaweedFS on 127.0.0.1); a test that starts it
skips, with the reason, when the ``weed`` binary is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._seaweed import ACCESS_KEY, MISSING, SECRET_KEY, Server, ServerMissing, stop
from benchmarks._seaweed import start as _start

__all__ = ["ACCESS_KEY", "SECRET_KEY", "Server", "start", "stop"]


def start(folder: Path, timeout: float = 90.0, ports: dict[str, int] | None = None) -> Server:
    """``benchmarks._seaweed.start``, skipping the test without the server."""
    try:
        return _start(folder, timeout, ports)
    except ServerMissing:
        pytest.skip(MISSING)
