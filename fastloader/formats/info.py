"""What a pack holds, in a few lines: what ``fastloader-pack --info`` and ``fastloader info`` print.

Torch-free, like the rest of formats/ (the commands start fast).
"""

from __future__ import annotations

import os

from fastloader.formats import read_metadata
from fastloader.formats.metadata import human_size
from fastloader.formats.records import UNBOUND_VERSION


def describe(path: str) -> str:
    """Return a short description of the pack at ``path`` (what ``--info`` prints).

    Args:
        path: a pack written by ``fastloader-pack`` (either format).

    Raises:
        PackError: if the file is not a complete fastloader pack.
        FileNotFoundError: if it does not exist.
    """
    metadata = read_metadata(path)
    classes = metadata["classes"]
    names = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
    info = metadata.get("info") or {}
    lines = [
        f"path:     {path}",
        f"backend:  {metadata['backend']} (format version {metadata['version']})"
        + (
            ": record checksums not bound to positions; re-pack to bind them"
            if metadata["version"] <= UNBOUND_VERSION
            else ""
        ),
        f"store:    {metadata['store']}",
        f"count:    {metadata['count']}",
        f"classes:  {len(classes)}" + (f" ({names})" if classes else ""),
        f"size:     {human_size(os.path.getsize(path))}",
    ]
    schema = metadata.get("schema")
    if schema is not None:  # a pack of any sample
        lines[4] = f"samples:  {schema['structure']} of {len(schema['fields'])} fields"
        columns = metadata.get("columns")
        stored = columns["fields"] if columns else [None] * len(schema["fields"])
        lines[5:5] = [
            f"  {_field_text(field)}{_column_text(column)}"
            for field, column in zip(schema["fields"], stored, strict=True)
        ]
        lines.insert(3, f"layout:   {_layout_text(columns)}")
        if not any(field["kind"] == "image" for field in schema["fields"]):
            lines[2] = "store:    - (no image field: the store mode applies to images only)"
    if info:
        lines.append("info:")
        lines += [f"  {key}: {value}" for key, value in sorted(info.items())]
    return "\n".join(lines)


def _field_text(field: dict) -> str:
    if field["kind"] == "array":
        return f"{field['name']}: {field['ndim']}-d array of {field['dtype']}"
    return f"{field['name']}: {field['kind']}"


def _layout_text(columns: dict | None) -> str:
    if columns is None:
        return "records (one checked record per sample: format 4; re-pack for batch reads)"
    return (
        f"columns (a batch is one gather per field; a checksum per block of "
        f"{columns['rows_per_block']} rows)"
    )


def _column_text(column: dict | None) -> str:
    if column is None:
        return ""
    if column["storage"] == "ragged":
        return " (ragged: values by offsets)"
    shape = "x".join(map(str, column["shape"])) or "scalar"
    return f" (fixed: {shape} {column['dtype']} per row)"
