"""What ``pack()`` wrote, as one headline and the files it skipped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastloader.formats.metadata import human_size


@dataclass
class PackSummary:
    """What :func:`pack` wrote.

    Attributes:
        path: the pack written.
        format: ``"lmdb"`` or ``"hdf5"``.
        store: ``"encoded"``, ``"raw"`` or ``"jpeg"``.
        count: the number of records written.
        classes: the class names; a record's label indexes this list.
        skipped: ``(path or dataset index, reason)`` for every input that could not be read.
        size_bytes: the size of the file written.
        seconds: how long packing took.
        removed_partials: ``(path, pid)`` of each partial file of a packer process that no
            longer runs, removed before packing (see NOTE [ Atomic packing ]).
        replaced: with ``overwrite``, a line for the user when the pack replaced a ``path``
            that appeared or changed during the run, else None.
    """

    path: Path
    format: str
    store: str
    count: int
    classes: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    size_bytes: int = 0
    seconds: float = 0.0
    removed_partials: list[tuple[Path, int]] = field(default_factory=list)
    replaced: str | None = None  # see NOTE [ Publishing the pack ]

    def headline(self) -> str:
        """One line: what was packed, where, how big, how fast."""
        return (
            f"packed {self.count} {self._what()} into {self.path} "
            f"({self.format}, store={self.store}, {human_size(self.size_bytes)}) "
            f"in {self.seconds:.{1 if self.seconds >= 1 else 2}f} s"  # a quick pack is not "0.0 s"
        )

    def _what(self) -> str:
        if not self.classes:  # a pack of any sample
            return "samples"
        return f"images of {len(self.classes)} classes"

    def __str__(self) -> str:
        lines = [
            f"removed {path}, left by packer process {pid} that no longer runs"
            for path, pid in self.removed_partials
        ]
        lines += [self.replaced] if self.replaced else []
        lines.append(self.headline())
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} unreadable:")
            lines += [f"  {where}: {reason}" for where, reason in self.skipped[:20]]
            if len(self.skipped) > 20:
                lines.append(f"  ... and {len(self.skipped) - 20} more")
        return "\n".join(lines)
