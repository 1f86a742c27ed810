"""A folder store that behaves like a remote one (no local path: shards go through the cache),
counting downloads in a log file (shared by processes) and optionally slow or damaging."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from fastloader.shards.stores import LocalStore


class RemoteLike(LocalStore):
    def __init__(self, folder, log=None, slow=0.0, damage=()):
        super().__init__(folder)
        self.url = f"remote-like://{folder}"
        self.log, self.slow, self.damage = log, slow, tuple(damage)

    def local_path(self, name):
        return None

    def download(self, name, dest: Path, size=None) -> None:
        if self.log is not None:
            with open(self.log, "a") as handle:
                handle.write(f"{os.getpid()} {name}\n")
        if self.slow:
            data = self.path(name).read_bytes()
            with open(dest, "wb") as handle:
                handle.write(data[: len(data) // 2])
                handle.flush()
                time.sleep(self.slow)
                handle.write(data[len(data) // 2 :])
        else:
            shutil.copyfile(self.path(name), dest)
        if name in self.damage:
            data = bytearray(dest.read_bytes())
            data[len(data) // 2] ^= 0xFF
            dest.write_bytes(bytes(data))


def downloads(log) -> list[str]:
    return (
        [line.split()[1] for line in Path(log).read_text().splitlines()]
        if Path(log).exists()
        else []
    )
