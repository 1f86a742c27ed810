"""fastloader: a drop-in, faster torch DataLoader with packed LMDB/HDF5 datasets."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

# NOTE [ Lazy public API ]
# The names below are imported from their modules on first use (PEP 562), so that importing a
# submodule that needs no torch (fastloader.cli for `--help`, a usage error) does not pay for
# importing torch (seconds on a loaded machine). `from fastloader import DataLoader` works as
# before; so do `fastloader.DataLoader` and `dir(fastloader)`. Public submodules are reachable
# the same way (`fastloader.vision.transforms.RandomResizedCrop` after `import fastloader`). No name
# is both: `fastloader.pack` is the function, its module is fastloader.packing.pack.
_EXPORTS = {
    "PoisonSampleError": "fastloader.loader.supervision",
    "WorkersLostError": "fastloader.loader.supervision",
    "DataLoader": "fastloader.loader.dataloader",
    "DevicePrefetcher": "fastloader.device",
    "EpochStats": "fastloader.stats.timing",
    "HDF5Dataset": "fastloader.datasets.packs",
    "HDF5FileDataset": "fastloader.datasets.users_files",
    "LMDBFileDataset": "fastloader.datasets.users_files",
    "ImageFolder": "fastloader.vision.folder",
    "LMDBDataset": "fastloader.datasets.packs",
    "LoaderStats": "fastloader.stats.timing",
    "Mix": "fastloader.sampling.mix",
    "MixSample": "fastloader.sampling.mix",
    "Normalize": "fastloader.device",
    "PackSummary": "fastloader.packing",
    "PackError": "fastloader.formats",
    "ShardedDataset": "fastloader.datasets.sharded",
    "ShardOrderSampler": "fastloader.sampling.shard_order",
    "move_to_device": "fastloader.device",
    "open_pack": "fastloader.datasets.packs",
    "pack": "fastloader.packing",
    "pin": "fastloader.device",
    "read_metadata": "fastloader.formats",
    "resolve_device": "fastloader.device",
    "timed_iter": "fastloader.stats.timing",
    "verify": "fastloader.formats.verify",
    "VerifyReport": "fastloader.formats.verify",
}
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
    "Mix",
    "MixSample",
    "Normalize",
    "PackSummary",
    "PackError",
    "PoisonSampleError",
    "ShardedDataset",
    "ShardOrderSampler",
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
    from fastloader.datasets import collate
    from fastloader.datasets.packs import HDF5Dataset, LMDBDataset, open_pack
    from fastloader.datasets.sharded import ShardedDataset
    from fastloader.datasets.users_files import HDF5FileDataset, LMDBFileDataset
    from fastloader.device import (
        DevicePrefetcher,
        Normalize,
        move_to_device,
        pin,
        resolve_device,
    )
    from fastloader.formats import PackError, read_metadata
    from fastloader.formats.verify import VerifyReport, verify
    from fastloader.loader.dataloader import DataLoader
    from fastloader.loader.supervision import PoisonSampleError, WorkersLostError
    from fastloader.packing import PackSummary, pack
    from fastloader.sampling.mix import Mix, MixSample
    from fastloader.sampling.shard_order import ShardOrderSampler
    from fastloader.stats.timing import EpochStats, LoaderStats, timed_iter
    from fastloader.vision.folder import ImageFolder


# NOTE [ Public module paths ]
# The package is cut into subpackages by idea (docs/layout.md), but the documented module paths
# stay: `fastloader.transforms`, `fastloader.collate`, `fastloader.samplers`, ... are the modules
# named here, reachable as attributes after `import fastloader` (imported on first use) and by
# `import fastloader.transforms` / `from fastloader.samplers import BlockShuffleSampler` (the
# finder below answers for exactly these names, with the module itself, so both paths give one
# module object and one set of classes). This table is the one list of public module paths.
PUBLIC_MODULES = {
    "cli": "fastloader.cli",
    "collate": "fastloader.datasets.collate",
    "datasets": "fastloader.datasets",
    "decoding": "fastloader.vision.decoding",
    "device": "fastloader.device",
    "distributed": "fastloader.sampling.distributed",
    "folder": "fastloader.vision.folder",
    "formats": "fastloader.formats",
    "images": "fastloader.vision.images",
    "lightning": "fastloader.lightning",
    "loader": "fastloader.loader",
    "packing": "fastloader.packing",
    "samplers": "fastloader.sampling.samplers",
    "sampling": "fastloader.sampling",
    "seeding": "fastloader.loader.seeding",
    "stats": "fastloader.stats",
    "transforms": "fastloader.vision.transforms",
    "vision": "fastloader.vision",
}
_SUBMODULES = frozenset(PUBLIC_MODULES)


class _PublicPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import fastloader.<public path>`` with the module that holds it."""

    def __init__(self) -> None:
        self._own_specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, name = fullname.rpartition(".")
        real = PUBLIC_MODULES.get(name) if prefix == "fastloader" else None
        if real is None or real == fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(PUBLIC_MODULES[spec.name.rpartition(".")[2]])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # the import system has just set __spec__ to the alias's: give the module its own back
        for alias, spec in list(self._own_specs.items()):
            if spec.name == module.__name__:
                module.__spec__ = self._own_specs.pop(alias)


sys.meta_path.insert(0, _PublicPathFinder())


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(PUBLIC_MODULES[name])
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
