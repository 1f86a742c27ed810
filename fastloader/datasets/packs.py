"""The torch datasets over packs: ``LMDBDataset``, ``HDF5Dataset`` and their base ``PackedDataset``.

Runs in whichever process reads (the main process, or each DataLoader worker). The reading
core (fork-safe opening, checked records, source paths) is ``fastloader.formats``, which needs
no torch: ``LMDBDataset`` is the backend's torch-free reader ``LMDBPack`` with
``PackedDataset``'s decoding and transforms (see NOTE [ Torch-free pack files ] in
formats/__init__.py, and NOTE [ Fork-safe readers ] in formats/packfile.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from fastloader.datasets.columns import ColumnBatch
from fastloader.datasets.field_samples import (
    check_fields_options,
    load_column_samples,
    load_fields,
    read_columns,
)
from fastloader.formats.hdf5 import HDF5Pack
from fastloader.formats.lmdb import LMDBPack
from fastloader.formats.pack_writer import PackWriter
from fastloader.formats.packfile import PackFile, check_file, file_identity
from fastloader.formats.records import PackError, Record, RecordKind
from fastloader.vision.decoding import fuse
from fastloader.vision.images import looks_like_image_folder
from fastloader.vision.stored_images import DECODE_MODES, StoredImageError, decode_image

__all__ = [
    "DECODE_MODES",
    "HDF5Dataset",
    "LMDBDataset",
    "PackError",
    "PackFile",
    "PackWriter",
    "PackedDataset",
    "StoredImageError",
    "check_file",
    "decode_image",
    "file_identity",
    "open_pack",
]


class PackedDataset(PackFile, Dataset):
    """Base of the packed-file datasets: an ImageFolder-like map-style dataset over one file.

    A backend's dataset is its ``PackFile`` reader with this class: ``class LMDBDataset(
    LMDBPack, PackedDataset)`` (below).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        decode: str | None = None,
        *,
        verify_checksums: bool = True,
        sample_transform: Callable | None = None,
        with_geometry: bool = False,
        image_transform: Callable | None = None,
    ) -> None:
        if decode is not None and decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        self.transform = transform
        self.target_transform = target_transform
        self.sample_transform = sample_transform
        self.image_transform = image_transform
        self.with_geometry = with_geometry  # NOTE [ Crop box and flip ] in field_samples.py
        with _image_folder_hint(path, self.backend):
            PackFile.__init__(self, path, verify_checksums=verify_checksums)
        # NOTE [ One meaning per argument ] in field_samples.py
        self.decode = decode or ("pil" if self.schema is None else "numpy")
        if self.decode != "bytes":  # planned here, so that the main process warns if on Pillow
            fuse(transform if self.schema is None else image_transform)
        self._image_field = check_fields_options(self)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Read, decode and transform a whole batch in one read transaction."""
        return self.getitems_with(indices, None)

    def getitems_with(
        self, indices: Sequence[int], before_each: Callable[[int], None] | None
    ) -> list[tuple[Any, Any]]:
        """``__getitems__``, calling ``before_each(index)`` before each sample is loaded.

        fastloader.DataLoader seeds each sample's RNGs there (NOTE [ Seeding contract ]), so
        augmentations stay per sample while the batch is read in one transaction.
        """
        pending = iter(indices)

        def load(position: int, buffer: Any) -> tuple[Any, Any]:
            index = next(pending)
            if before_each is not None:
                before_each(index)
            return self._load(position, buffer)

        positions = [self._position(index) for index in indices]
        if self.layout == "columns":  # NOTE [ Packs laid out by columns ]
            return load_column_samples(self, indices, positions, before_each)
        self.advise_records(positions)  # NOTE [ Read advice for packs bigger than memory ]
        return self._read_each(self._handle_here(), positions, load)

    def read_batch_columns(self, indices: Sequence[int]) -> ColumnBatch | None:
        """The samples ``indices`` of a pack laid out by columns as one ``ColumnBatch`` for the
        loader's default collate (NOTE [ Batches read by columns ] in datasets/columns.py), its
        blocks' checksums verified; None where a sample needs code of the user's or a decode
        per sample (see ``field_samples.read_columns``). Raises as ``__getitems__``."""
        if type(self) not in (LMDBDataset, HDF5Dataset):  # a subclass reads its own way
            return None
        return read_columns(self, indices)

    def _load(self, position: int, buffer: Any) -> tuple[Any, Any]:
        """Decode and transform one record, fusing the two where the transform allows.

        See NOTE [ Fused decoding ] in fastloader/vision/decoding.py (raw pixels are cropped
        from the file's memory before any copy).
        """
        if self.schema is not None:  # a pack of any sample
            return load_fields(self, position, buffer)
        fused = fuse(self.transform) if self.decode != "bytes" else None
        where = f"{self.path} record {position}"
        if fused is None:  # decoded, checked (NOTE [ Checksum after the copy ]), transformed

            def decode(record: Record) -> tuple[Any, int]:
                return decode_image(record, self.decode, where), record.label

            return self.apply_transforms(self._checked(position, buffer, decode))

        def fused_decode(record: Record) -> tuple[Any, int]:
            if record.kind is RecordKind.RAW:
                pixels = np.frombuffer(record.payload, dtype=np.uint8).reshape(record.shape)
                return fused.apply_raw(pixels, self.decode), record.label
            plain = lambda: decode_image(record, self.decode, where)  # noqa: E731
            image = fused.apply_encoded(record.payload, plain, self.decode, where)
            return image, record.label

        image, label = self._checked(position, buffer, fused_decode)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def __getstate__(self) -> dict[str, Any]:
        state = PackFile.__getstate__(self)
        state.pop("_fields_reader", None)  # planned again where it is read (closures inside)
        state.pop("_columns_plan", None)  # holds the transforms: planned again too
        return state

    def apply_transforms(self, sample: tuple[Any, int]) -> tuple[Any, Any]:
        """Apply ``transform`` and ``target_transform`` to a decoded ``(image, label)``."""
        image, label = sample
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def pil_images_advice(self) -> str:
        """What turns this pack's PIL images into arrays or tensors, for the collate's error
        (NOTE [ Advice that fits the dataset ] in collate.py)."""
        name = type(self).__name__
        if self.decode != "pil":  # the images came from the transform
            return (
                f"this {name}'s transform returns PIL images: end it with "
                "fastloader.transforms.PILToTensor()"
            )
        return (
            f"a pack decodes images to PIL by default (decode='pil'): read it with "
            f"{name}(..., decode='numpy') (HxWxC uint8 arrays) or decode='tensor' (CxHxW "
            "uint8 tensors), or end its transform with fastloader.transforms.PILToTensor()"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, {len(self)} samples, "
            f"{len(self.classes)} classes, store={self.store!r}, decode={self.decode!r})"
        )


class LMDBDataset(LMDBPack, PackedDataset):
    """An ImageFolder-like dataset over a pack written by ``fastloader-pack`` in LMDB format.

    Args:
        path: the ``.lmdb`` file.
        transform: applied to each image of an (image, label) pack (as torchvision
            transforms are); to the whole sample of a pack of fields, as for a user's file
            read in place (docs/any-sample.md, "One meaning per argument").
        target_transform: applied to each label.
        decode: how images come back: "pil" (RGB image), "tensor" (uint8 CHW), "numpy"
            (uint8 HWC), or "bytes" (the stored payload). Default "pil" for an (image, label)
            pack, "numpy" for a pack of fields (arrays, as the file it was made from).
        verify_checksums: check each record's (or block of rows') checksum as it is read
            (default True).
        sample_transform: for a pack of fields, applied to the whole sample after
            ``transform`` (kept for packs made before ``transform`` took the whole sample).
        image_transform: for a pack of fields, applied to the image field (the first), fused
            with decoding where it can be (what ``transform`` did before format 5's
            release).
        with_geometry: for a pack of dict samples, add ``"<image field>_geometry"``: the crop
            box and flip a fused ``transform`` applied (NOTE [ Crop box and flip ]).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is empty, truncated, damaged, not a fastloader LMDB pack, unfinished,
            or from another format version.
        ValueError: for an unknown ``decode``.

    An LMDB environment that is not a fastloader pack (a folder with ``data.mdb``, or a file
    whose keys are not a pack's) is read in place: see
    ``fastloader.datasets.users_files.LMDBFileDataset``,
    which ``LMDBDataset(path, keys=..., decode=callable, transform=...)`` then returns
    (NOTE [ Packs or users' own files ]).
    """

    def __new__(cls, path: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cls is LMDBDataset and path is not None and _foreign(path, "lmdb"):
            from fastloader.datasets.users_files import LMDBFileDataset

            _check_foreign_arguments(path, args, kwargs)
            with _image_folder_hint(path, "lmdb"):
                return LMDBFileDataset(path, *args, **kwargs)
        return super().__new__(cls)


class HDF5Dataset(HDF5Pack, PackedDataset):
    """An ImageFolder-like dataset over a pack written by ``fastloader-pack`` in HDF5 format.

    Args:
        path: the ``.h5``/``.hdf5`` file.
        transform, target_transform, decode, verify_checksums, sample_transform,
            image_transform, with_geometry: as ``LMDBDataset``'s (one meaning for both formats).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is empty, truncated, damaged, not a fastloader HDF5 pack (or not laid
            out as fastloader writes them), unfinished, or from another format version.
        ValueError: for an unknown ``decode``.

    An HDF5 file that is not a fastloader pack (a user's own file of aligned datasets) is read
    in place: ``HDF5Dataset(path, fields=None, transform=None, as_tuple=False)`` then returns a
    ``fastloader.HDF5FileDataset`` whose samples are ``{dataset name: row}`` dicts
    (NOTE [ Packs or users' own files ]; docs/any-sample.md).
    """

    def __new__(cls, path: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cls is HDF5Dataset and path is not None and _foreign(path, "hdf5"):
            from fastloader.datasets.users_files import HDF5FileDataset

            if kwargs.get("decode", "") in (None, "numpy"):  # NOTE [ One meaning per argument ]
                kwargs.pop("decode")  # arrays: what a user's file gives anyway
            _check_foreign_arguments(path, args, kwargs)
            return HDF5FileDataset(path, *args, **kwargs)
        return super().__new__(cls)


# NOTE [ Packs or users' own files ]
# One name opens both: `HDF5Dataset("pose.h5")` on a user's file must not fail with "not a
# fastloader pack". The class's __new__ looks at the file first (formats.hdf5.
# is_hdf5_pack, formats.lmdb_foreign.is_lmdb_pack: the top-level names, or the first and last
# keys) and returns the foreign dataset for anything that is not laid out as a pack; Python then
# skips __init__, since the object is not an HDF5Dataset. A damaged, truncated or interrupted
# pack still goes to the pack reader, which says what is wrong with it. Subclasses and
# unpickling (which calls __new__ without a path) always get the pack dataset.


_PACK_ONLY = (
    "decode",
    "image_transform",
    "target_transform",
    "verify_checksums",
    "sample_transform",
    "with_geometry",
)


def _check_foreign_arguments(path: Any, args: tuple, kwargs: dict) -> None:
    """A user's own file takes the foreign dataset's arguments: say so for a pack's."""
    given = [
        name
        for name in _PACK_ONLY
        if name in kwargs and not (name == "decode" and callable(kwargs[name]))  # LMDB's own
    ]
    if given:
        raise TypeError(
            f"{path}: not a fastloader pack but a user's own file, read in place: "
            f"{given[0]}= applies to packs (see docs/any-sample.md)"
        )


@contextlib.contextmanager
def _image_folder_hint(path: Any, backend: str) -> Iterator[None]:
    """A pack's error on a folder of class folders of images says how to read that."""
    try:
        yield
    except PackError as error:
        if not looks_like_image_folder(path):
            raise
        folder = Path(path)
        packed = folder.name + (".h5" if backend == "hdf5" else ".lmdb")
        raise PackError(
            f"{error}. It looks like an image folder: read it with "
            f"fastloader.ImageFolder({str(folder)!r}), or pack it once with "
            f"`fastloader-pack {folder} {packed}` and read the pack"
        ) from None


def _foreign(path: Any, backend: str) -> bool:
    if not isinstance(path, (str, os.PathLike)) or not os.path.exists(path):
        return False  # the pack reader raises the error
    if backend == "hdf5":
        from fastloader.formats.hdf5 import is_hdf5_pack

        return not os.path.isdir(path) and not is_hdf5_pack(path)
    from fastloader.formats.lmdb_foreign import is_lmdb_pack

    return not is_lmdb_pack(path)


def open_pack(path: str | os.PathLike, **kwargs: Any) -> LMDBDataset | HDF5Dataset:
    """Open a pack of either format, recognised by its content; kwargs go to the dataset.

    Only packs: a user's own HDF5 file or LMDB environment is refused (``HDF5Dataset`` and
    ``LMDBDataset`` read those in place).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        PackError: if it is not a complete, readable fastloader pack.
    """
    from pathlib import Path

    from fastloader.formats import sniff_format

    path = Path(path)
    check_file(path)
    cls = {"lmdb": LMDBDataset, "hdf5": HDF5Dataset}[sniff_format(path)]
    dataset = PackedDataset.__new__(cls)  # a pack, never a user's own file
    dataset.__init__(path, **kwargs)
    return dataset
