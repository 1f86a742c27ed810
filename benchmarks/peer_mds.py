"""MosaicML ``streaming`` (MDS) as a peer row, run in its own venv through a subprocess.

``mosaicml-streaming`` pins NumPy < 2.2 and pulls torchvision and transformers, so it lives in a
side venv that sees the main environment's torch (install: docs/benchmarks.md, "Peers"). The
benchmark talks to one subprocess per loader (``python -m benchmarks.peer_mds`` in that venv):
the subprocess builds its ``StreamingDataset`` and torch ``DataLoader`` once (persistent
workers), then answers one line of JSON per command on stdin: ``epoch`` (samples and seconds of
one epoch), ``digest`` (the epoch's checksum, benchmarks/peer_samples.py) and ``quit``. So its
epochs interleave with fastloader's, which run in the benchmark's own process.

The venv's python: ``$FASTLOADER_MDS_PYTHON``, else this python when it imports ``streaming``.

NOTE [ MDS workers and a shared boto3 connection ]
``StreamingDataset`` fetches its ``index.json`` in the main process, which makes the stream's
boto3 client and opens a connection. Forked DataLoader workers inherit that client and its
socket: each worker's requests then read the others' responses, and shards in the cache held
another shard's bytes (seen here, issue 37). So every stream's client is dropped
(``_downloader._s3_client = None``) before the loader forks; each worker makes its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

INSTALL = (
    "not installed: python -m venv --system-site-packages VENV; VENV/bin/pip install --no-deps "
    "mosaicml-streaming==0.13.0 zstd python-snappy cramjam Brotli catalogue; stub torchvision "
    "and transformers in VENV (docs/benchmarks.md, Peers); FASTLOADER_MDS_PYTHON=VENV/bin/python"
)
NAME = "MosaicML MDS StreamingDataset, torch DataLoader"
TIMEOUT = 900  # seconds one command (an epoch, or making the loader) may take
COLUMNS = {"uint8": "ndarray:uint8", "float32": "ndarray:float32", "float64": "ndarray:float64"}


def python() -> str | None:
    """The python that imports ``streaming``, or None (then the row says how to install it)."""
    chosen = os.environ.get("FASTLOADER_MDS_PYTHON")
    if chosen:
        return chosen if Path(chosen).exists() else None
    return sys.executable if importlib.util.find_spec("streaming") else None


class MDSPeer:
    """One MDS loader in the side venv; ``epoch()`` and ``digest()`` run there."""

    def __init__(self, config: dict) -> None:
        exe = python()
        if exe is None:
            raise ImportError(INSTALL)
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.process = subprocess.Popen(
            [exe, "-m", "benchmarks.peer_mds", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
            text=True,
        )
        self._ask(None)  # ready: the dataset and loader are made

    def _ask(self, command: str | None) -> dict:
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        watchdog = threading.Timer(TIMEOUT, self.process.kill)  # a hung peer: its row fails
        watchdog.start()
        try:
            return self._answer(command)
        finally:
            watchdog.cancel()

    def _answer(self, command: str | None) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                code = self.process.wait(timeout=60)
                raise RuntimeError(f"MDS subprocess exited ({code}) before answering {command!r}")
            if line.startswith("{"):  # anything else is the peer's own chatter
                return json.loads(line)

    def epoch(self) -> tuple[int, float]:
        """(samples, seconds) of one epoch."""
        answer = self._ask("epoch")
        return answer["samples"], answer["seconds"]

    def digest(self) -> tuple[int, str]:
        """(samples, checksum) of one epoch."""
        answer = self._ask("digest")
        return answer["samples"], answer["digest"]

    def close(self) -> None:
        """Ends the subprocess (and its workers)."""
        if self.process.poll() is None:
            try:
                self._ask("quit")
            finally:
                self.process.wait(timeout=60)


def build(source: Path, out: Path, shard_bytes: int = 1 << 26) -> None:
    """Writes the HDF5 file's rows as MDS shards into ``out`` (run in the side venv)."""
    import h5py
    from streaming import MDSWriter

    from benchmarks.peer_samples import read_rows

    with h5py.File(source, "r") as file:
        columns = {
            name: COLUMNS.get(
                str(file[name].dtype), "str" if file[name].dtype.kind == "S" else "int"
            )
            for name in file
        }
        count = len(file[next(iter(columns))])
    with MDSWriter(out=str(out), columns=columns, size_limit=shard_bytes) as writer:
        for start in range(0, count, 1024):
            for sample in read_rows(source, start, min(count, start + 1024)):
                writer.write(sample)


def build_in_venv(source: Path, out: Path, shard_bytes: int = 1 << 26) -> None:
    """Writes MDS shards of the HDF5 file with the side venv's python (see :func:`build`)."""
    exe = python()
    if exe is None:
        raise ImportError(INSTALL)
    root = str(Path(__file__).resolve().parent.parent)
    spec = {"source": str(source), "local": str(out), "shard_bytes": shard_bytes}
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [exe, "-m", "benchmarks.peer_mds", "build", json.dumps(spec)],
        env=env,
        cwd=root,
        check=True,
        timeout=1800,
    )


def _loader(config: dict) -> Any:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    options: dict[str, Any] = {"local": config["local"], "shuffle": True}
    if config.get("remote"):
        options.update(remote=config["remote"], cache_limit=config.get("cache_limit"))
    dataset = StreamingDataset(batch_size=config["batch"], **options)
    for stream in dataset.streams:  # NOTE [ MDS workers and a shared boto3 connection ]
        downloader = getattr(stream, "_downloader", None)
        if downloader is not None and hasattr(downloader, "_s3_client"):
            downloader._s3_client = None
    workers = config["workers"]
    return DataLoader(
        dataset, batch_size=config["batch"], num_workers=workers, persistent_workers=workers > 0
    )


def serve(config: dict) -> None:
    """The side venv's loop: one loader, one JSON line per command (see the docstring)."""
    from benchmarks.peer_samples import epoch_digest, timed_epoch

    loader = _loader(config)
    fields = tuple(config["fields"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "epoch":
            samples, seconds = timed_epoch(loader, fields[0])
            answer: dict = {"samples": samples, "seconds": seconds}
        elif command == "digest":
            samples, digest = epoch_digest(loader, fields)
            answer = {"samples": samples, "digest": digest}
        else:
            print(json.dumps({"bye": True}), flush=True)
            return
        print(json.dumps(answer), flush=True)


def upload(folder: Path, bucket: str, prefix: str) -> str:
    """Uploads the MDS folder (or any folder) to ``s3://bucket/prefix``; returns the URL."""
    import boto3

    client = boto3.client("s3")
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            client.upload_file(str(file), bucket, f"{prefix}/{file.relative_to(folder)}")
    return f"s3://{bucket}/{prefix}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "build":  # python -m benchmarks.peer_mds build CFG
        spec = json.loads(sys.argv[2])
        build(Path(spec["source"]), Path(spec["local"]), spec.get("shard_bytes", 1 << 26))
    else:
        serve(json.loads(sys.argv[1]))
