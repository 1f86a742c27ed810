"""Shards in S3 or an S3-compatible store, through boto3 (the ``remote`` extra).

NOTE [ One client per process ]
boto3 was chosen over fsspec/s3fs and obstore: it is the reference client for S3 and every
S3-compatible server (the endpoint from ``AWS_ENDPOINT_URL`` or ``endpoint_url=``), its
standard credential chain refreshes expiring credentials (roles, SSO, instance metadata) by
itself, its "standard" retry mode backs off on timeouts, 5xx, throttling and SlowDown, and it
starts no runtime or thread at import (s3fs is not fork-safe, fsspec/s3fs #914; obstore's
runtime started before a fork hangs workers). Its clients cannot be pickled and share a
connection pool, and a pool shared across a fork lets two processes read each other's
responses (MosaicML streaming's cache held one shard's bytes under another's name). So an
``S3Store`` holds only the URL and options: its client is made on first use in each process
(``_client``, keyed by pid) and never pickled, and a forked child drops the clients it
inherited (``os.register_at_fork``) before it could use one. A body cut off mid-download is
fetched again from where it stopped (a ranged GET), with backoff, up to ``retries`` times.
What a child keeps is botocore's loader: the parsed JSON of the service models and endpoints,
read-only data, no socket, no lock. Parsing it is most of a client's making (~140 ms idle,
~500 ms on the busy 2-core box: a loader worker that downloaded its first shard itself took
0.5 s for 4 MB, the cold epoch's critical path); with the parent's loader a child's client
takes ~20 ms. Its credentials, session and pool are still its own. Clients are made under
``_MAKING`` (botocore sessions are not thread-safe; two threads needing one wait for one).

NOTE [ Parallel ranged GETs ]
One S3 connection gives ~100 MB/s at best, and each GET waits a first-byte latency (tens of
ms). A shard of at least ``2 x range_min`` bytes is fetched as up to ``ranges`` byte ranges at
once (threads in the downloading process sharing its client, whose pool holds a connection per
range), each written at its offset into the one temporary file (``os.pwrite``; the file is
sized first). A range cut off or failed is fetched again from where it stopped, with backoff,
up to ``retries`` times, as a whole download is; a range that gives up stops the others and
its error is raised. The cache then checks the whole file's size and checksum as for one GET
(NOTE [ The shard cache ]), so a range written wrong is never read.

NOTE [ Hashed on the way ]
A shard that comes in one stream (one GET, and ranged GETs resuming it from where it was cut,
each in order) is hashed as its bytes are written: the cache then checks that digest rather
than reading the file back (a 4 MB shard's read-back and hash took 1-10 ms of the main
process's CPU while the readers waited for the first batch). Every byte is written before it
is hashed (``_write_all``: a short ``pwrite`` is finished, never skipped), so the digest is of
the file's bytes; the cache still checks the file's size. Ranges come out of order: their
file is read back and hashed whole.

NOTE [ Cloud Storage through its S3 API ]
``gs://bucket/prefix`` is the same store over Google Cloud Storage's XML API, which serves the
S3 API to S3 clients (Google's "simple migration": its endpoint and an HMAC key in place of
AWS's keys). So a ``gs://`` store is an ``S3Store`` whose endpoint defaults to
``GCS_ENDPOINT`` (``endpoint_url=`` overrides it; ``AWS_ENDPOINT_URL``, set for S3, does not),
whose key is ``GS_ACCESS_KEY_ID`` and ``GS_SECRET_ACCESS_KEY`` (named after gsutil's boto
config keys) and nothing of AWS's credential chain: on a host with AWS credentials (a role, a
profile) they are never sent to Google, and an S3 and a Cloud Storage store each have a client
of their own in one process.
Its errors name the ``gs://`` URL and those variables, and its client sends
botocore's own checksums only where an operation requires them (``when_required``): the
CRC32 trailers botocore 1.36 added to every upload are an S3 extension that other servers of
the S3 API may refuse; the shards' own XXH3 digests are what fastloader checks. Tested against
the loopback S3 server standing in for Cloud Storage (tests/test_remote.py), not against
Cloud Storage itself. Azure Blob Storage has no S3 API: ``az://`` is refused, naming a
mounted folder (blobfuse2) as the way.

Credentials never appear in a URL, an error or a repr here: errors name the store's URL and
the endpoint only.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["EXTRA", "GCS_ENDPOINT", "S3Store"]

EXTRA = "pip install 'fastloader[remote]'"
GCS_ENDPOINT = "https://storage.googleapis.com"  # NOTE [ Cloud Storage through its S3 API ]
_CLIENTS: dict[tuple, Any] = {}  # (pid, gs://, endpoint, retries, timeout) -> a client
_LOADER: list[Any] = []  # botocore's parsed models, kept across a fork (NOTE above)
_MAKING = threading.Lock()  # clients are made one at a time
_CHUNK = 8 << 20
_RANGE_MIN = 8 << 20  # bytes of a range at least: NOTE [ Parallel ranged GETs ]
_COUNTING = threading.Lock()  # S3Store.requests


def _forget_clients() -> None:
    global _MAKING
    _CLIENTS.clear()  # the parent's connections are not ours: NOTE [ One client per process ]
    _MAKING = threading.Lock()  # a thread of the parent's may have held it at the fork


os.register_at_fork(after_in_child=_forget_clients)


def _boto3() -> Any:
    try:
        import boto3
        import botocore  # noqa: F401
    except ImportError:
        raise ImportError(f"s3:// and gs:// URLs need the remote extra: {EXTRA} (boto3)") from None
    return boto3


class S3Store:
    """The shards under ``s3://bucket/prefix``, or ``gs://bucket/prefix`` through Cloud
    Storage's S3 API (NOTE [ Cloud Storage through its S3 API ]).

    Args:
        url: ``s3://bucket/prefix`` or ``gs://bucket/prefix`` (the prefix may be empty).
        endpoint_url: an S3-compatible endpoint; default ``$AWS_ENDPOINT_URL``, else AWS
            (for ``gs://``: ``GCS_ENDPOINT``).
        retries: attempts per request (boto3's standard retry mode: backoff on timeouts, 5xx,
            throttling) and per download (a cut-off body resumes with a ranged GET).
        timeout: seconds to connect and between bytes read.
        ranges: byte ranges fetched at once for a large shard (NOTE [ Parallel ranged GETs ]).
        range_min: the fewest bytes of a range: smaller shards are fetched in one GET.

    Raises:
        ImportError: without the ``remote`` extra, naming it.
        ValueError: for a URL without a bucket.
    """

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        retries: int = 8,
        timeout: float = 30.0,
        ranges: int = 4,
        range_min: int = _RANGE_MIN,
    ) -> None:
        _boto3()
        scheme, _, rest = url.partition("://")
        self.gcs = scheme == "gs"
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{url}: no bucket (expected {scheme}://bucket/prefix)")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"{scheme}://{bucket}/{self.prefix}".rstrip("/")
        default = GCS_ENDPOINT if self.gcs else os.environ.get("AWS_ENDPOINT_URL")
        self.endpoint_url = endpoint_url or default or None
        self.retries, self.timeout = retries, timeout
        self.ranges, self.range_min = max(1, int(ranges)), max(1, int(range_min))
        self.requests = 0  # requests this process made through this store (the cache's stats)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint_url={self.endpoint_url!r})"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self, name: str) -> str:
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"{self.url}/{name}{at}"

    def _client(self) -> Any:
        key = (os.getpid(), self.gcs, self.endpoint_url, self.retries, self.timeout)
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        with _MAKING:
            if key not in _CLIENTS:
                _CLIENTS[key] = self._new_client()
            return _CLIENTS[key]

    def _new_client(self) -> Any:
        """A client of this process's own, on botocore's loader if this process (or its
        parent, before a fork) has one (NOTE [ One client per process ])."""
        import botocore.session
        from botocore.config import Config

        options = dict(
            retries={"max_attempts": self.retries, "mode": "standard"},
            connect_timeout=self.timeout,
            read_timeout=self.timeout,
            max_pool_connections=max(10, self.ranges),  # a connection per range
            # the shard's XXH3 is checked whole (NOTE [ The shard cache ]): botocore's own
            # checksum of every body as well is work done twice
            response_checksum_validation="when_required",
        )
        if self.gcs:  # NOTE [ Cloud Storage through its S3 API ]
            options["request_checksum_calculation"] = "when_required"
        try:
            config = Config(**options)
        except TypeError:  # botocore before 1.36 sends and validates no such checksums
            options.pop("response_checksum_validation")
            options.pop("request_checksum_calculation", None)
            config = Config(**options)
        session = botocore.session.get_session()
        if _LOADER:
            session.register_component("data_loader", _LOADER[0])
        else:
            _LOADER.append(session.get_component("data_loader"))
        keys: dict[str, str] = {}
        if self.gcs:  # its HMAC key only: NOTE [ Cloud Storage through its S3 API ]
            keys = _gcs_key()
        return session.create_client("s3", endpoint_url=self.endpoint_url, config=config, **keys)

    def _call(self, name: str, method: str, **kwargs: Any) -> Any:
        """``client.method(**kwargs)`` with errors that name the object, never credentials."""
        from botocore import exceptions

        with _COUNTING:  # ranges of one shard call from several threads
            self.requests += 1
        try:
            return getattr(self._client(), method)(Bucket=self.bucket, **kwargs)
        except exceptions.NoCredentialsError:
            raise PermissionError(f"{self._where(name)}: {self._no_credentials()}") from None
        except exceptions.ClientError as error:
            raise _client_error(error, self._where(name), self._credentials()) from None
        except exceptions.BotoCoreError as error:  # connection refused, timeouts: retried
            raise ConnectionError(
                f"{self._where(name)}: {type(error).__name__} after {self.retries} attempts"
            ) from None

    def _credentials(self) -> str:
        return "Cloud Storage HMAC key (GS_ACCESS_KEY_ID)" if self.gcs else "S3 credentials"

    def _no_credentials(self) -> str:
        if self.gcs:  # NOTE [ Cloud Storage through its S3 API ]
            return (
                "no Cloud Storage HMAC key: create one (gcloud storage hmac create "
                "SERVICE_ACCOUNT_EMAIL) and set GS_ACCESS_KEY_ID and GS_SECRET_ACCESS_KEY to "
                "its access ID and secret (gs:// goes through Cloud Storage's S3 API)"
            )
        return (
            "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE, or run where a role provides them)"
        )

    def local_path(self, name: str) -> Path | None:
        return None

    def exists(self, name: str) -> bool:
        try:
            self._call(name, "head_object", Key=self._key(name))
        except FileNotFoundError:
            return False
        return True

    def read_bytes(self, name: str, limit: int) -> bytes:
        response = self._call(name, "get_object", Key=self._key(name))
        if response["ContentLength"] > limit:
            response["Body"].close()
            raise ValueError(f"{self._where(name)}: larger than {limit} bytes")
        return response["Body"].read()

    def download(self, name: str, dest: Path, size: int | None = None) -> str | None:
        """Fetch ``name`` into ``dest``; a body cut off resumes where it stopped. With its
        ``size`` known, a large object comes as parallel ranges (NOTE [ Parallel ranged
        GETs ]). Returns the XXH3-64 of the bytes written when they came in one stream, in
        order (hashed as they arrive: NOTE [ Hashed on the way ]), else None."""
        parts = 1 if size is None else min(self.ranges, size // self.range_min)
        failed = threading.Event()
        with open(dest, "wb") as handle:
            if parts < 2:
                digest = xxhash.xxh3_64()
                self._fetch_range(name, handle.fileno(), 0, None, failed, digest)
                return digest.hexdigest()
            handle.truncate(size)
            bounds = [size * k // parts for k in range(parts + 1)]
            with ThreadPoolExecutor(parts, thread_name_prefix="shard-range") as pool:
                futures = [
                    pool.submit(self._fetch_range, name, handle.fileno(), start, end, failed)
                    for start, end in zip(bounds, bounds[1:], strict=False)
                ]
                for future in futures:
                    future.result()  # a range's error, raised here
        return None

    def _fetch_range(
        self,
        name: str,
        fd: int,
        start: int,
        end: int | None,
        failed: threading.Event,
        digest: Any = None,
    ) -> None:
        """Bytes ``[start, end)`` of ``name`` (to its end if None) written at their offset in
        ``fd`` (and added to ``digest``, in order); resumed from where a cut-off body stopped,
        with backoff."""
        from botocore import exceptions

        at = start
        for attempt in range(self.retries):
            if failed.is_set():
                return  # another range gave up: its error is the download's
            wanted = {} if end is None and not at else {"Range": f"bytes={at}-{_last(end)}"}
            try:
                response = self._call(name, "get_object", Key=self._key(name), **wanted)
                expected = at + response["ContentLength"]
                body = response["Body"]
                while chunk := body.read(_CHUNK):
                    at = _write_all(fd, chunk, at)
                    if digest is not None:
                        digest.update(chunk)
                if at >= expected:
                    return
            except (ConnectionError, exceptions.BotoCoreError, OSError) as error:
                if isinstance(error, FileNotFoundError | PermissionError):
                    failed.set()
                    raise
                if attempt == self.retries - 1:
                    failed.set()
                    raise ConnectionError(
                        f"{self._where(name)}: download failed after {self.retries} "
                        f"attempts ({type(error).__name__})"
                    ) from None
            time.sleep(min(10.0, 0.1 * 2**attempt) * (0.5 + random.random()))
        failed.set()
        raise ConnectionError(f"{self._where(name)}: the body was cut off {self.retries} times")

    def upload(self, source: Path, name: str) -> None:
        with open(source, "rb") as handle:
            self._call(name, "put_object", Key=self._key(name), Body=handle)

    def put_bytes(self, name: str, data: bytes) -> None:
        self._call(name, "put_object", Key=self._key(name), Body=data)  # one PUT: atomic

    def delete(self, name: str) -> None:
        self._call(name, "delete_object", Key=self._key(name))


def _write_all(fd: int, data: bytes, at: int) -> int:
    """``data`` written at offset ``at`` of ``fd``, all of it; the offset after it."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        at, view = at + written, view[written:]
    return at


def _last(end: int | None) -> str:
    """The last byte of a range ending before ``end`` (HTTP ranges are inclusive)."""
    return "" if end is None else str(end - 1)


def _gcs_key() -> dict[str, str]:
    """The Cloud Storage HMAC key from the environment, as botocore's client arguments."""
    from botocore.exceptions import NoCredentialsError

    access, secret = os.environ.get("GS_ACCESS_KEY_ID"), os.environ.get("GS_SECRET_ACCESS_KEY")
    if not (access and secret):
        raise NoCredentialsError()  # named by S3Store._call
    return {"aws_access_key_id": access, "aws_secret_access_key": secret}


def _client_error(error: Any, where: str, credentials: str) -> OSError:
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchKey", "404", "NotFound"):
        return FileNotFoundError(f"{where}: no such object")
    if code == "NoSuchBucket":
        return FileNotFoundError(f"{where}: no such bucket")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return PermissionError(f"{where}: access denied ({code}): check the {credentials}")
    return ConnectionError(f"{where}: S3 error {code or status}")
