"""How a file says what it is: the first bytes of an HDF5 file (one definition for every check)."""

from __future__ import annotations

import os

#: The 8 bytes an HDF5 file starts with (at offset 0 for every file fastloader reads).
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file that starts with the HDF5 signature."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as file:
        return file.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
