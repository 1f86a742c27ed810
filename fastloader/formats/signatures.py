"""How a file says what it is: the first bytes of an HDF5 or LMDB file (one definition for every
check)."""

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


#: LMDB's magic number, at this offset of an LMDB file (after the first meta page's header).
LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")
LMDB_MAGIC_OFFSET = 16


def file_kind(path: str | os.PathLike) -> str | None:
    """ "hdf5" or "lmdb" for a regular file that starts as one, else None."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as file:
        start = file.read(LMDB_MAGIC_OFFSET + len(LMDB_MAGIC))
    if start.startswith(HDF5_SIGNATURE):
        return "hdf5"
    if start[LMDB_MAGIC_OFFSET:] == LMDB_MAGIC:
        return "lmdb"
    return None


def not_hdf5_hint(path: str | os.PathLike) -> str:
    """What a file h5py cannot open is, when it is an LMDB file or pack; "" otherwise."""
    if file_kind(path) != "lmdb":
        return ""
    from fastloader.formats.lmdb_foreign import is_lmdb_pack

    what = "a fastloader LMDB pack" if is_lmdb_pack(path) else "an LMDB file"
    return f"{what}, not an HDF5 file: read it with fastloader.LMDBDataset"
