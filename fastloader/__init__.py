"""fastloader: a drop-in, faster torch DataLoader with packed LMDB/HDF5 datasets."""

from fastloader._supervision import PoisonSampleError, WorkersLostError
from fastloader.device import DevicePrefetcher, move_to_device, pin, resolve_device
from fastloader.formats import HDF5Dataset, LMDBDataset, PackError, open_pack, read_metadata
from fastloader.loader import DataLoader
from fastloader.pack import PackSummary, pack
from fastloader.stats import EpochStats, LoaderStats, timed_iter
from fastloader.transforms import Normalize

__all__ = [
    "DataLoader",
    "DevicePrefetcher",
    "EpochStats",
    "HDF5Dataset",
    "LMDBDataset",
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
    "WorkersLostError",
]
__version__ = "0.1.0"
