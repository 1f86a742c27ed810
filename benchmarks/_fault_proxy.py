"""A loopback HTTP proxy for fault tests: 503 storms, stalls, cut-off bodies, dropped connections;
and a shaped link for benchmarks: a first-byte latency and a bandwidth per connection.

One request per connection (it answers ``Connection: close``; boto3 opens another). Faults are
queued per kind and spent one request at a time, only on requests whose path contains
``match``; everything else is forwarded to the upstream server untouched (``latency`` seconds
before its first byte, then at most ``bandwidth`` bytes a second, when given). ``ranges``
records each request line with its ``Range`` header ("" without one).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlparse


class FaultProxy:
    def __init__(self, upstream: str, latency: float = 0.0, bandwidth: float = 0.0) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.faults: list[tuple[str, str, float]] = []  # (kind, match, argument)
        self.served: list[tuple[str, str]] = []  # (request line, what was done)
        self.ranges: list[tuple[str, str]] = []  # (request line, its Range header)
        self.latency, self.bandwidth = latency, bandwidth
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def add(self, kind: str, count: int = 1, match: str = "", argument: float = 0.0) -> None:
        """Queue ``count`` faults: "503", "stall" (``argument`` seconds), "cut" (the body cut
        after ``argument`` bytes), "drop" (the connection closed unanswered)."""
        with self.lock:
            self.faults += [(kind, match, argument)] * count

    def _take(self, line: str) -> tuple[str, float] | None:
        with self.lock:
            for at, (kind, match, argument) in enumerate(self.faults):
                if match in line:
                    del self.faults[at]
                    return kind, argument
        return None

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            request = _read_message(client)
            if request is None:
                return
            line = request.split(b"\r\n", 1)[0].decode("latin-1")
            fault = self._take(line)
            self.served.append((line, fault[0] if fault else "forwarded"))
            self.ranges.append((line, _header(request, b"range")))
            if fault and fault[0] == "drop":
                return
            if fault and fault[0] == "503":
                body = b"<Error><Code>SlowDown</Code><Message>Reduce your rate</Message></Error>"
                head = b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                head += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                client.sendall(head + body)
                return
            if fault and fault[0] == "stall":
                time.sleep(fault[1])
            try:
                response = self._forward(request)
            except OSError:  # the upstream went away (a test's end): nothing to answer
                return
            if fault and fault[0] == "cut":
                head, _, body = response.partition(b"\r\n\r\n")
                response = head + b"\r\n\r\n" + body[: int(fault[1])]
            try:
                self._send(client, response)
            except OSError:
                pass

    def _send(self, client: socket.socket, response: bytes) -> None:
        """``response``, after ``latency`` and at ``bandwidth`` when shaped."""
        if self.latency:
            time.sleep(self.latency)
        if not self.bandwidth:
            client.sendall(response)
            return
        started, step = time.perf_counter(), 1 << 16
        for at in range(0, len(response), step):
            client.sendall(response[at : at + step])
            ahead = (at + step) / self.bandwidth - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)

    def _forward(self, request: bytes) -> bytes:
        head, _, body = request.partition(b"\r\n\r\n")
        lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"connection:")]
        request = b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n" + body
        with socket.create_connection(self.upstream) as upstream:
            upstream.sendall(request)
            chunks = []
            while chunk := upstream.recv(1 << 16):
                chunks.append(chunk)
        response = b"".join(chunks)
        head, _, body = response.partition(b"\r\n\r\n")
        lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"connection:")]
        return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n" + body


def _header(message: bytes, name: bytes) -> str:
    head = message.partition(b"\r\n\r\n")[0]
    for header in head.split(b"\r\n")[1:]:
        key, _, value = header.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return ""


def _read_message(sock: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for header in head.split(b"\r\n")[1:]:
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def shaped_link(upstream: str, latency: float, bandwidth: float) -> tuple[str, Any]:
    """A shaping proxy in its own process (its threads take no GIL from the measured loader):
    its endpoint and the process, to ``terminate()``."""
    code = (
        "import sys, time\n"
        "from benchmarks._fault_proxy import FaultProxy\n"
        "proxy = FaultProxy(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))\n"
        "print(proxy.endpoint, flush=True)\n"
        "sys.stdin.read()\n"  # until the parent closes it (or dies)
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, upstream, str(latency), str(bandwidth)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return process.stdout.readline().strip(), process
