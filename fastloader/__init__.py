"""fastloader: a drop-in, faster torch DataLoader with packed LMDB/HDF5 datasets."""

from fastloader.device import DevicePrefetcher, move_to_device, pin, resolve_device
from fastloader.loader import DataLoader
from fastloader.stats import EpochStats, LoaderStats, timed_iter
from fastloader.transforms import Normalize

__all__ = [
    "DataLoader",
    "DevicePrefetcher",
    "EpochStats",
    "LoaderStats",
    "Normalize",
    "move_to_device",
    "pin",
    "resolve_device",
    "timed_iter",
]
__version__ = "0.1.0"
