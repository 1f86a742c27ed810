"""Where the shards of a sharded pack live: a local (or shared) folder, or an object store.

A store holds named objects: the shards and ``manifest.json``. ``open_store`` picks one from a
path or URL. A folder is read in place (no copies: NFS, Lustre); an ``s3://`` or ``gs://`` URL
goes through ``s3.py``, imported only then (its client library is the ``remote`` extra).
Stores hold no open connection and nothing unpicklable (NOTE [ One client per process ] in
s3.py), and their ``url`` never holds credentials.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Protocol

from fastloader.shards.manifest import MANIFEST_NAME, Manifest, parse_manifest

__all__ = ["LocalStore", "Store", "is_url", "open_store", "read_manifest", "temp_name"]

MAX_MANIFEST_BYTES = 64 << 20
REMOTE_SCHEMES = ("s3", "gs")  # gs://: NOTE [ Cloud Storage through its S3 API ] in s3.py
_AZURE_SCHEMES = ("az", "abfs", "abfss", "adl", "wasb", "wasbs")


class Store(Protocol):
    """What a sharded pack needs of the place its shards live."""

    url: str

    def read_bytes(self, name: str, limit: int) -> bytes: ...
    def download(self, name: str, dest: Path, size: int | None = None) -> str | None: ...
    def upload(self, source: Path, name: str) -> None: ...
    def put_bytes(self, name: str, data: bytes) -> None: ...
    def delete(self, name: str) -> None: ...
    def exists(self, name: str) -> bool: ...
    def local_path(self, name: str) -> Path | None: ...


def temp_name(name: str) -> str:
    """A hidden temporary name beside ``name`` for this process (never a shard's name)."""
    return f".{name}.partial-{os.getpid()}@{socket.gethostname()}"


class LocalStore:
    """A folder of shards, read in place."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(os.path.expanduser(os.fspath(folder)))
        self.url = str(self.folder)

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    def path(self, name: str) -> Path:
        return self.folder / name

    def local_path(self, name: str) -> Path | None:
        return self.path(name)

    def read_bytes(self, name: str, limit: int) -> bytes:
        with open(self.path(name), "rb") as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{self.path(name)}: larger than {limit} bytes")
        return data

    def download(self, name: str, dest: Path, size: int | None = None) -> str | None:
        shutil.copyfile(self.path(name), dest)
        return None  # not hashed on the way: the cache reads it back

    def upload(self, source: Path, name: str) -> None:
        if Path(source).resolve() == self.path(name).resolve():
            return
        temp = self.path(temp_name(name))
        try:
            shutil.copyfile(source, temp)
            _fsync(temp)
            os.replace(temp, self.path(name))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)

    def put_bytes(self, name: str, data: bytes) -> None:
        temp = self.path(temp_name(name))
        try:
            with open(temp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path(name))  # atomic: the old manifest or the new one
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        _fsync(self.folder)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path(name))

    def exists(self, name: str) -> bool:
        return self.path(name).exists()


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        handle = os.open(path, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` (``file://`` included)."""
    return isinstance(path, str) and "://" in path


def open_store(path_or_url: str | os.PathLike, **options: Any) -> Store:
    """The store at a folder path, a ``file://`` URL, or an ``s3://bucket/prefix`` or
    ``gs://bucket/prefix`` URL.

    Args:
        path_or_url: where the shards are.
        options: for ``s3://`` and ``gs://``: ``endpoint_url``, ``retries``, ``timeout``,
            ``ranges``, ``range_min`` (see ``fastloader.shards.s3.S3Store``).

    Raises:
        ValueError: for a URL scheme that is not supported, naming the ones that are.
        ImportError: for ``s3://`` or ``gs://`` without the ``remote`` extra, naming it.
    """
    if not is_url(path_or_url):
        return LocalStore(path_or_url)
    scheme, _, rest = str(path_or_url).partition("://")
    if scheme == "file":
        return LocalStore(rest)
    if scheme in _AZURE_SCHEMES:
        raise ValueError(
            f"{scheme}:// is not supported: Azure Blob Storage has no S3 API, which "
            "fastloader's client (boto3) speaks; mount the container (blobfuse2) and pass the "
            "folder, or copy the shards to S3 or Cloud Storage"
        )
    if scheme not in REMOTE_SCHEMES:
        raise ValueError(
            f"{scheme}:// is not supported: use a folder, file:// or "
            + ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
        )
    from fastloader.shards.s3 import S3Store

    return S3Store(str(path_or_url), **options)


def read_manifest(store: Store) -> Manifest:
    """The checked manifest of the sharded pack in ``store``.

    Raises:
        FileNotFoundError: when there is no manifest (not a sharded pack, or one whose packer
            did not finish).
        ManifestError: for a manifest that cannot be trusted, naming the field.
    """
    where = f"{store.url.rstrip('/')}/{MANIFEST_NAME}"
    try:
        raw = store.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{where}: no manifest: not a sharded pack, or its packer did not finish"
        ) from None
    return parse_manifest(raw, where)
