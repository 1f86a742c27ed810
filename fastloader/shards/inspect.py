"""``--info`` and ``--verify`` of a sharded pack, a folder or a URL (torch-free, as formats/)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from fastloader.formats import read_metadata
from fastloader.formats.metadata import human_size
from fastloader.formats.records import PackError
from fastloader.shards.manifest import MANIFEST_NAME, Manifest, Shard, file_checksum
from fastloader.shards.stores import Store, is_url, open_store, read_manifest

__all__ = ["check_shard_file", "describe_sharded", "is_sharded", "run_verify", "verify_sharded"]


def is_sharded(path: str | os.PathLike) -> bool:
    """True for a URL or a folder holding a manifest (what ``--info``/``--verify`` take as a
    sharded pack)."""
    if is_url(path):
        return True
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST_NAME))


def describe_sharded(path_or_url: str, **options: Any) -> str:
    """What ``--info`` prints for a sharded pack: its manifest, in a few lines."""
    store = open_store(path_or_url, **options)
    manifest = read_manifest(store)
    sizes = [shard.bytes for shard in manifest.shards]
    lines = [
        f"path:     {store.url}",
        f"sharded:  {len(manifest.shards)} shards of {manifest.backend} (manifest version "
        f"{manifest.version})",
        f"store:    {manifest.store}",
        f"count:    {manifest.count}",
        f"size:     {human_size(manifest.size_bytes)} (shards {human_size(min(sizes))} to "
        f"{human_size(max(sizes))})",
        _fingerprints(manifest),
    ]
    if manifest.schema is not None:
        fields = manifest.schema.get("fields") or []
        lines.append(f"samples:  {manifest.schema.get('structure')} of {len(fields)} fields")
        lines += [f"  {field.get('name')}: {field.get('kind')}" for field in fields]
    else:
        lines.append(f"classes:  {len(manifest.classes)}")
    return "\n".join(lines)


def _fingerprints(manifest: Manifest) -> str:
    """``--info``'s line on the shards' fingerprints (NOTE [ Shard fingerprints ])."""
    kept = sum(shard.metadata_xxh3_64 is not None for shard in manifest.shards)
    if kept == 0:
        return (
            "opened:   checked for count, schema and classes only (a manifest without "
            "fingerprints: run --verify after copying shards)"
        )
    return (
        f"opened:   checked against the metadata fingerprint of {kept} of "
        f"{len(manifest.shards)} shards, and count, schema and classes"
    )


def check_shard_file(path: Path, shard: Shard, where: str) -> None:
    """Raise PackError naming the shard unless the file at ``path`` has the manifest's size and
    checksum."""
    size = path.stat().st_size
    if size != shard.bytes:
        raise PackError(f"{where}: {size} bytes, the manifest says {shard.bytes}")
    digest = file_checksum(path)
    if digest != shard.xxh3_64:
        raise PackError(
            f"{where}: checksum {digest} does not match the manifest's {shard.xxh3_64} "
            "(the shard is damaged or was replaced)"
        )


def _verify_one(store: Store, shard: Shard, tmp: Path) -> list[str]:
    """What is wrong with one shard: its bytes against the manifest, then every record."""
    from fastloader.formats.verify import verify

    where = f"{store.url.rstrip('/')}/{shard.name}"
    local = store.local_path(shard.name)
    if local is None:
        local = tmp / shard.name
        store.download(shard.name, local)
    try:
        check_shard_file(local, shard, where)
        report = verify(local, progress=False)
        problem = shard.fingerprint_problem(read_metadata(local))  # NOTE [ Shard fingerprints ]
        if problem is not None:
            raise PackError(f"{where}: {problem}")
        problems = [f"{where}: record {index}: {why}" for index, why in report.bad]
        if report.records != shard.count:
            problems.append(f"{where}: {report.records} records, the manifest says {shard.count}")
        return problems
    except (PackError, OSError) as error:
        return [" ".join(str(error).split())]
    finally:
        if store.local_path(shard.name) is None:
            local.unlink(missing_ok=True)


def verify_sharded(path_or_url: str, **options: Any) -> tuple[Manifest, list[str]]:
    """Check every shard of a sharded pack: bytes against the manifest's size and checksum,
    then every record; returns the manifest and one line per problem (none: clean)."""
    store = open_store(path_or_url, **options)
    manifest = read_manifest(store)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fastloader-verify-") as tmp:
        for shard in manifest.shards:
            problems += _verify_one(store, shard, Path(tmp))
    return manifest, problems


def run_verify(path_or_url: str, quiet: bool, prog: str) -> int:
    """``--verify`` of a sharded pack: 0 clean, 1 bad shards or records, 2 unreadable."""
    try:
        manifest, problems = verify_sharded(path_or_url)
    except (PackError, OSError, ValueError, ImportError) as error:
        print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    for line in problems:
        print(line, file=sys.stderr)
    if not quiet:
        verdict = "OK" if not problems else f"{len(problems)} problems"
        print(
            f"{path_or_url}: {verdict}: {len(manifest.shards)} shards, {manifest.count} "
            "records and their checksums checked"
        )
    return 1 if problems else 0
