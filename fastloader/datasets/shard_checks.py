"""A shard opened as the manifest describes it, or refused naming the field (NOTE [ Shards
that disagree with their manifest ])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastloader.formats.records import PackError
from fastloader.shards.manifest import Manifest

__all__ = ["check_agrees"]

# NOTE [ Shards that disagree with their manifest ]
# Every shard is read as the manifest describes the pack: as many samples as its entry says,
# the same classes and the same schema (the packer gives shard 0's to every later shard: NOTE
# [ Packing shards ]). More samples in the manifest than in the shard read rows past the
# shard's end (an IndexError or ValueError naming nothing); fewer left samples out, silently.
# A shard that disagrees (a crafted or mixed-up manifest, a shard copied in from another
# pack) is refused when it is opened, naming it and the field: read anyway, a batch read by
# columns takes each column by its position in the plan, so fields in another order or an
# extra field would put one field's values under another's name, or drop a field, silently.


def check_agrees(pack: Any, manifest: Manifest, number: int, path: Path) -> None:
    """Raise ``PackError`` naming ``path`` (shard ``number``) and the field where the shard is
    not as ``manifest`` describes it (NOTE [ Shards that disagree with their manifest ])."""
    problem = None
    if len(pack) != manifest.shards[number].count:
        problem = f"{len(pack)} samples, the manifest says {manifest.shards[number].count}"
    problem = problem or _schema_difference(getattr(pack, "schema", None), manifest.schema)
    if problem is None and list(pack.classes) != list(manifest.classes):
        problem = f"classes {list(pack.classes)[:5]}..., the manifest's {manifest.classes[:5]}..."
    problem = problem or manifest.shards[number].fingerprint_problem(pack.metadata)
    if problem is not None:
        pack.close()
        raise PackError(f"{path}: this shard does not match the sharded pack's manifest: {problem}")


def _schema_difference(schema: dict | None, expected: dict | None) -> str | None:
    """What differs between a shard's schema and the manifest's (the first field), or None."""
    if schema == expected:
        return None
    if schema is None or expected is None:
        return f"schema {schema!r}, the manifest's {expected!r}"
    fields = [field.get("name") for field in schema.get("fields", [])]
    wanted = [field.get("name") for field in expected.get("fields", [])]
    if fields != wanted:
        extra, missing = sorted(set(fields) - set(wanted)), sorted(set(wanted) - set(fields))
        if extra or missing:
            return f"fields {extra} not in the manifest, {missing} missing"
        return f"fields in the order {fields}, the manifest's {wanted}"
    for field, want in zip(schema["fields"], expected["fields"], strict=True):
        if field != want:
            return f"field {field.get('name')!r} is {field}, the manifest's {want}"
    return f"schema {schema}, the manifest's {expected}"
