"""fastloader: a drop-in, faster torch DataLoader with packed LMDB/HDF5 datasets."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# NOTE [ Lazy public API ]
# The names below are imported from their modules on first use (PEP 562), so that importing a
# submodule that needs no torch (fastloader.cli for `--help`, a usage error) does not pay for
# importing torch (seconds on a loaded machine). `from fastloader import DataLoader` works as
# before; so do `fastloader.DataLoader` and `dir(fastloader)`. Public submodules are reachable
# the same way (`fastloader.transforms.RandomResizedCrop` after `import fastloader`). No name
# is both: `fastloader.pack` is the function, its module is fastloader.packing.
_EXPORTS = {
    "PoisonSampleError": "fastloader._supervision",
    "WorkersLostError": "fastloader._supervision",
    "DataLoader": "fastloader.loader",
    "DevicePrefetcher": "fastloader.device",
    "EpochStats": "fastloader.stats",
    "HDF5Dataset": "fastloader.datasets",
    "HDF5FileDataset": "fastloader.foreign",
    "LMDBFileDataset": "fastloader.foreign",
    "ImageFolder": "fastloader.folder",
    "LMDBDataset": "fastloader.datasets",
    "LoaderStats": "fastloader.stats",
    "Normalize": "fastloader.device",
    "PackSummary": "fastloader.packing",
    "PackError": "fastloader.formats",
    "move_to_device": "fastloader.device",
    "open_pack": "fastloader.datasets",
    "pack": "fastloader.packing",
    "pin": "fastloader.device",
    "read_metadata": "fastloader.formats",
    "resolve_device": "fastloader.device",
    "timed_iter": "fastloader.stats",
    "verify": "fastloader.formats.verify",
    "VerifyReport": "fastloader.formats.verify",
}
_SUBMODULES = {"collate"}  # public modules: fastloader.collate.pad_ragged, ...
__all__ = [
    "DataLoader",
    "DevicePrefetcher",
    "EpochStats",
    "HDF5Dataset",
    "HDF5FileDataset",
    "ImageFolder",
    "LMDBDataset",
    "LMDBFileDataset",
    "LoaderStats",
    "Normalize",
    "PackSummary",
    "PackError",
    "PoisonSampleError",
    "move_to_device",
    "open_pack",
    "pack",
    "pin",
    "read_metadata",
    "resolve_device",
    "timed_iter",
    "verify",
    "VerifyReport",
    "WorkersLostError",
    "collate",
]
__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from fastloader import collate
    from fastloader._supervision import PoisonSampleError, WorkersLostError
    from fastloader.datasets import HDF5Dataset, LMDBDataset, open_pack
    from fastloader.device import (
        DevicePrefetcher,
        Normalize,
        move_to_device,
        pin,
        resolve_device,
    )
    from fastloader.folder import ImageFolder
    from fastloader.foreign import HDF5FileDataset, LMDBFileDataset
    from fastloader.formats import PackError, read_metadata
    from fastloader.formats.verify import VerifyReport, verify
    from fastloader.loader import DataLoader
    from fastloader.packing import PackSummary, pack
    from fastloader.stats import EpochStats, LoaderStats, timed_iter


# Public submodules, reachable as attributes after `import fastloader` (imported on first use).
_SUBMODULES = frozenset(
    {
        "cli",
        "datasets",
        "decoding",
        "device",
        "distributed",
        "folder",
        "formats",
        "images",
        "lightning",
        "loader",
        "packing",
        "samplers",
        "seeding",
        "stats",
        "transforms",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"fastloader.{name}")
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
