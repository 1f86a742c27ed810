"""The packed datasets: each backend's torch-free reader with PackedDataset's decoding.

Kept apart from lmdb.py and hdf5.py so that reading a pack's metadata or verifying it imports
no torch (NOTE [ Torch-free pack files ] in formats/__init__.py).
"""

from __future__ import annotations

from fastloader.formats.base import PackedDataset
from fastloader.formats.hdf5 import HDF5Pack
from fastloader.formats.lmdb import LMDBPack

__all__ = ["HDF5Dataset", "LMDBDataset"]


class LMDBDataset(LMDBPack, PackedDataset):
    """An ImageFolder-like dataset over a pack written by ``fastloader-pack`` in LMDB format.

    Args:
        path: the ``.lmdb`` file.
        transform: applied to each image (as torchvision transforms are).
        target_transform: applied to each label.
        decode: "pil" (RGB image, default), "tensor" (uint8 CHW), "numpy" (uint8 HWC), or
            "bytes" (the stored payload).
        verify_checksums: check each record's checksum as it is read (default True).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is empty, truncated, damaged, not a fastloader LMDB pack, unfinished,
            or from another format version.
        ValueError: for an unknown ``decode``.
    """


class HDF5Dataset(HDF5Pack, PackedDataset):
    """An ImageFolder-like dataset over a pack written by ``fastloader-pack`` in HDF5 format.

    Args:
        path: the ``.h5``/``.hdf5`` file.
        transform: applied to each image (as torchvision transforms are).
        target_transform: applied to each label.
        decode: "pil" (RGB image, default), "tensor" (uint8 CHW), "numpy" (uint8 HWC), or
            "bytes" (the stored payload).
        verify_checksums: check each record's checksum as it is read (default True).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is empty, truncated, damaged, not a fastloader HDF5 pack (or not laid
            out as fastloader writes them), unfinished, or from another format version.
        ValueError: for an unknown ``decode``.
    """
