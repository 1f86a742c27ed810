"""A loopback HTTP proxy for fault tests: 503 storms, stalls, cut-off bodies, dropped connections.

One request per connection (it answers ``Connection: close``; boto3 opens another). Faults are
queued per kind and spent one request at a time, only on requests whose path contains
``match``; everything else is forwarded to the upstream server untouched.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.faults: list[tuple[str, str, float]] = []  # (kind, match, argument)
        self.served: list[tuple[str, str]] = []  # (request line, what was done)
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
                client.sendall(response)
            except OSError:
                pass

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
