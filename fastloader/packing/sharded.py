"""``pack(..., shard_size=...)``: a dataset written as many ordinary packs (shards) + a manifest.

NOTE [ Packing shards ]
Each shard is written by ``pack()`` itself, over a slice of the source (so every check, store
mode and checksum of a pack holds for a shard), then uploaded (a folder: renamed into it) as
soon as it is finished. A shard's sample count is chosen so that shards come out near
``shard_size`` (NOTE [ Sizing shards ]).
Classes and the schema of shard 0 are given to every later shard, so all shards agree. The
manifest (NOTE [ The shard manifest ] in shards/manifest.py) is written last, atomically; an
existing one is deleted first when overwriting, so a killed or failed packer never leaves a
sharded pack that opens, only shards no manifest names.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fastloader.formats import read_metadata
from fastloader.formats.metadata import human_size
from fastloader.formats.signatures import is_hdf5_file
from fastloader.packing.jobs import scan_image_folder
from fastloader.shards.manifest import MANIFEST_NAME, Manifest, Shard, file_checksum
from fastloader.shards.sizes import parse_size
from fastloader.shards.stores import is_url, open_store

__all__ = ["ShardedSummary", "pack_shards"]

_PROBE = 64  # samples packed to measure (and a quarter of them: NOTE [ Sizing shards ])
_SUFFIX = {"lmdb": "lmdb", "hdf5": "h5"}


@dataclass
class ShardedSummary:
    """What ``pack(..., shard_size=...)`` wrote."""

    path: str
    format: str
    store: str
    count: int
    classes: list[str]
    shards: list[Shard]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    size_bytes: int = 0
    seconds: float = 0.0
    removed_partials: list = field(default_factory=list)
    replaced: str | None = None

    def headline(self) -> str:
        """One line: what was packed, where, how big, how fast."""
        return (
            f"packed {self.count} samples into {len(self.shards)} shards at {self.path} "
            f"({self.format}, store={self.store}, {human_size(self.size_bytes)}) "
            f"in {self.seconds:.1f} s"
        )

    def __str__(self) -> str:
        return self.headline()


class _FileSamples:
    """An image folder's files as ``(bytes, label)`` samples (packed as the files' bytes)."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str]) -> None:
        self.samples, self.classes = samples, classes
        self.targets = [label for _, label in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        path, label = self.samples[index]
        with open(path, "rb") as handle:
            return handle.read(), label


class _Slice:
    """Samples ``indices`` of a dataset, as a dataset (picklable when the dataset is)."""

    def __init__(self, dataset: Any, indices: np.ndarray) -> None:
        self.dataset, self.indices = dataset, indices
        if hasattr(dataset, "classes"):
            self.classes = dataset.classes

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.indices[index])]


def _source_dataset(source: Any) -> Any:
    if isinstance(source, (str, os.PathLike)):
        if is_hdf5_file(source):
            from fastloader.formats.hdf5_foreign import HDF5File

            return HDF5File(os.path.expanduser(os.fspath(source)))
        return _FileSamples(*scan_image_folder(source))
    return source


def pack_shards(
    pack_one: Callable[..., Any],
    source: Any,
    dst: str | os.PathLike,
    shard_size: int | str,
    *,
    format: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    shuffle_seed: int | None = None,
    classes: Any = None,
    schema: dict | None = None,
    endpoint_url: str | None = None,
    **options: Any,
) -> ShardedSummary:
    """Pack ``source`` into shards of about ``shard_size`` bytes at ``dst`` (NOTE [ Packing
    shards ]); ``pack_one`` is ``fastloader.pack`` and ``options`` go to it for each shard.

    Raises:
        FileExistsError: if ``dst`` already holds a manifest and ``overwrite`` is False.
        ValueError: for a bad ``shard_size`` or ``format``, and whatever ``pack()`` raises.
    """
    started = time.perf_counter()
    target_size = parse_size(shard_size, "shard_size")
    format = format or "lmdb"
    if format not in _SUFFIX:
        raise ValueError(f"format must be one of {', '.join(_SUFFIX)}, got {format!r}")
    store = open_store(dst, **({} if endpoint_url is None else {"endpoint_url": endpoint_url}))
    _prepare(store, dst, overwrite)
    dataset = _source_dataset(source)
    count = len(dataset)
    order = np.arange(count) if shuffle_seed is None else _permutation(shuffle_seed, count)
    show = sys.stderr.isatty() if progress is None else progress
    state = _Run(pack_one, store, format, dict(options, classes=classes, schema=schema))
    with tempfile.TemporaryDirectory(prefix=".fastloader-shards-", dir=_temp_parent(dst)) as tmp:
        state.tmp = Path(tmp)
        state.probe(dataset, order[:_PROBE])
        with tqdm(total=count, desc=f"{store.url} shards", unit="sample", disable=not show) as bar:
            start = 0
            while start < count:
                chunk = order[start : start + state.samples_per_shard(target_size)]
                state.write(dataset, chunk)
                start += len(chunk)
                bar.update(len(chunk))
                bar.set_postfix_str(f"{len(state.shards)} shards written")
    manifest = Manifest(state.shards, format, state.store_mode, state.classes, state.schema)
    store.put_bytes(MANIFEST_NAME, manifest.to_json())  # last: NOTE [ Packing shards ]
    return ShardedSummary(
        store.url,
        format,
        state.store_mode,
        manifest.count,
        state.classes,
        state.shards,
        state.skipped,
        manifest.size_bytes,
        time.perf_counter() - started,
    )


def _temp_parent(dst: Any) -> str | None:
    """Shards of a folder are written beside it (one file system: a rename, no copy)."""
    if is_url(dst):
        return None
    return str(Path(os.path.expanduser(os.fspath(dst))))


def _prepare(store: Any, dst: Any, overwrite: bool) -> None:
    if store.exists(MANIFEST_NAME):
        if not overwrite:
            raise FileExistsError(
                f"{store.url}: already a sharded pack (overwrite=True replaces it)"
            )
        store.delete(MANIFEST_NAME)  # first: a half-replaced pack must not open
    if not is_url(dst):
        os.makedirs(os.path.expanduser(os.fspath(dst)), exist_ok=True)


def _permutation(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(count)


class _Run:
    """The shards written so far, and what every later shard must agree with."""

    def __init__(self, pack_one: Callable, store: Any, format: str, options: dict) -> None:
        self.pack_one, self.store, self.format, self.options = pack_one, store, format, options
        self.shards: list[Shard] = []
        self.skipped: list[tuple[str, str]] = []
        self.classes: list[str] = []
        self.schema: dict | None = None
        self.store_mode = options.get("store", "encoded")
        self.tmp = Path(".")
        self._sizes = [0, 0]  # bytes, samples of the shards written
        self.fixed, self.per_sample = 0.0, 1.0  # a pack's bytes: NOTE [ Sizing shards ]

    # NOTE [ Sizing shards ]
    # A pack's size is fixed bytes (its metadata, LMDB's pages of keys, a column pack's block
    # tables: ~32 KB for a column pack of any sample size) plus bytes per sample. Taking the
    # bytes per sample as size / count counted the fixed part as per-sample bytes: a target
    # near the fixed part gave shards of one sample. So the first 16 and 64 samples are each
    # packed once (written, measured, deleted): per_sample = (size64 - size16) / 48, fixed =
    # size16 - 16 x per_sample; a shard holds (target - fixed) / per_sample samples, at least
    # one (a target below the fixed bytes gives shards of one sample). As shards are written,
    # per_sample follows their bytes, the fixed part taken off each shard, kept within 2x of the
    # probe's (LMDB's 4 KB pages make a small shard's bytes jump).

    def samples_per_shard(self, target: int) -> int:
        """How many samples the next shard holds (NOTE [ Sizing shards ])."""
        per_sample = self.per_sample
        if self._sizes[1]:  # within 2x of the probe's: pages make small shards' bytes jump
            measured = (self._sizes[0] - len(self.shards) * self.fixed) / self._sizes[1]
            per_sample = min(max(measured, per_sample / 2), per_sample * 2)
        return max(1, int((target - self.fixed) // max(per_sample, 1.0)))

    def probe(self, dataset: Any, indices: np.ndarray) -> None:
        """``fixed`` and ``per_sample`` from packs of the first samples (NOTE [ Sizing
        shards ])."""
        sizes = [
            self._probe_size(dataset, part) for part in (indices[: len(indices) // 4], indices)
        ]
        few, many = len(indices) // 4, len(indices)
        if few == 0 or many == few or sizes[1] <= sizes[0]:  # too few samples to tell
            self.per_sample = sizes[1] / max(1, many)
            return
        self.per_sample = (sizes[1] - sizes[0]) / (many - few)
        self.fixed = max(0.0, sizes[0] - few * self.per_sample)

    def _probe_size(self, dataset: Any, indices: np.ndarray) -> int:
        if not len(indices):
            return 0
        path = self.tmp / f"probe.{_SUFFIX[self.format]}"
        summary = self._pack(_Slice(dataset, indices), path)
        os.remove(path)
        return summary.size_bytes

    def _pack(self, dataset: Any, path: Path) -> Any:
        options = dict(self.options, format=self.format, progress=False, overwrite=True)
        if self.shards:  # every shard as shard 0: NOTE [ Packing shards ]
            options.update(classes=self.classes or options.get("classes"), schema=self.schema)
        return self.pack_one(dataset, path, **options)

    def write(self, dataset: Any, indices: np.ndarray) -> None:
        name = f"shard-{len(self.shards):05d}.{_SUFFIX[self.format]}"
        local, path = self.store.local_path(name), self.tmp / name
        summary = self._pack(_Slice(dataset, indices), path)
        metadata = read_metadata(path)
        if not self.shards:
            self.classes, self.schema = list(metadata["classes"]), metadata.get("schema")
            self.store_mode = metadata["store"]
        self.skipped += [(f"{name}: {where}", why) for where, why in summary.skipped]
        size, digest = path.stat().st_size, file_checksum(path)
        # the shard's metadata checksum: NOTE [ Shard fingerprints ] in shards/manifest.py
        shard = Shard(name, summary.count, size, digest, metadata["checksum"])
        if local is not None:
            os.replace(path, local)  # the same file system: _temp_parent
        else:
            self.store.upload(path, name)
            os.remove(path)
        self.shards.append(shard)
        self._sizes[0] += shard.bytes
        self._sizes[1] += len(indices)
