"""fastloader: a drop-in, faster torch DataLoader with packed LMDB/HDF5 datasets."""

from fastloader.loader import DataLoader

__all__ = ["DataLoader"]
__version__ = "0.1.0"
