"""PackedDataset: what every packed-file reader shares (lazy, fork-safe opening and decoding).

See NOTE [ Fork-safe readers ].
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastloader.decoding import fuse
from fastloader.formats.images import to_rgb
from fastloader.formats.records import (
    PackError,
    Record,
    RecordKind,
    decode_record,
    dump_metadata,
    make_metadata,
)

DECODE_MODES = ("pil", "tensor", "numpy", "bytes")

# NOTE [ Fork-safe readers ]
# An LMDB environment or HDF5 file opened in one process must not be used by another: a forked
# worker that inherits the parent's handle shares its file offsets, locks and caches, which
# crashes or silently corrupts reads. So a dataset holds no open handle when it is created or
# pickled: it opens its file on first read in the process that reads, remembers that process's
# pid, and opens a new handle when it finds itself in a different process (a fork). The handle is
# never part of the pickled state, so spawn and forkserver workers open their own too. (LMDB
# needs one more step: see _Environments in lmdb.py.)


class PackedDataset(Dataset):
    """Base of the packed-file readers: an ImageFolder-like map-style dataset over one file.

    Subclasses implement ``_open``, ``_load_index`` and ``_read_each``.
    """

    backend = ""

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        decode: str = "pil",
    ) -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        self.path = Path(path)
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such packed file")
        if self.path.is_dir():
            raise PackError(f"{self.path}: is a directory, not a packed file")
        self._handle: Any = None
        self._pid: int | None = None
        handle = self._open()
        try:
            self.metadata, self.targets = self._load_index(handle)
        finally:
            self._close_handle(handle)
        self.classes: list[str] = list(self.metadata["classes"])
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}
        self.store: str = self.metadata["store"]

    # --- backend interface -------------------------------------------------------------------
    def _open(self) -> Any:
        """Open the file read-only; raise PackError naming it if it cannot be a pack."""
        raise NotImplementedError

    def _load_index(self, handle: Any) -> tuple[dict, np.ndarray]:
        """Return the checked metadata and the int64 labels."""
        raise NotImplementedError

    def _read_each(self, handle: Any, indices: Sequence[int], use: Callable) -> list:
        """Return ``[use(i, buffer) for i in indices]``, in order, in one read transaction."""
        raise NotImplementedError

    def _close_handle(self, handle: Any) -> None:
        handle.close()

    # --- Dataset -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.targets)

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
        return self._read_each(self._handle_here(), positions, load)

    def _load(self, position: int, buffer: Any) -> tuple[Any, Any]:
        """Decode and transform one record, fusing the two where the transform allows.

        See NOTE [ Fused decoding ] in fastloader/decoding.py (raw pixels are cropped from the
        file's memory before any copy).
        """
        fused = fuse(self.transform) if self.decode != "bytes" else None
        if fused is None:
            return self.apply_transforms(self._decoded(position, buffer))
        record = self._record(position, buffer)
        if record.kind is RecordKind.RAW:
            pixels = np.frombuffer(record.payload, dtype=np.uint8).reshape(record.shape)
            image = fused.apply_raw(pixels, self.decode)
        else:
            where = f"{self.path} record {position}"
            plain = lambda: decode_image(record, self.decode, where)  # noqa: E731
            image = fused.apply_encoded(record.payload, plain, self.decode)
        label = record.label
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def apply_transforms(self, sample: tuple[Any, int]) -> tuple[Any, Any]:
        """Apply ``transform`` and ``target_transform`` to a decoded ``(image, label)``."""
        image, label = sample
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def read_record(self, index: int) -> Record:
        """Return record ``index`` undecoded (its payload copied out of the file)."""

        def copy(position: int, buffer: Any) -> Record:
            record = self._record(position, buffer)
            return record._replace(payload=memoryview(bytes(record.payload)))

        return self._read_each(self._handle_here(), [self._position(index)], copy)[0]

    def close(self) -> None:
        """Close the file in this process (it reopens on the next read)."""
        if self._handle is not None and self._pid == os.getpid():
            self._close_handle(self._handle)
        self._handle = None
        self._pid = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_pid"] = None
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, {len(self)} samples, "
            f"{len(self.classes)} classes, store={self.store!r}, decode={self.decode!r})"
        )

    # --- helpers -------------------------------------------------------------------------------
    def _handle_here(self) -> Any:
        pid = os.getpid()
        if self._handle is None or self._pid != pid:
            self._handle = self._open()
            self._pid = pid
        return self._handle

    def _position(self, index: int) -> int:
        count = len(self.targets)
        if isinstance(index, torch.Tensor | np.integer):
            index = int(index)
        if not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        position = index + count if index < 0 else index
        if not 0 <= position < count:
            raise IndexError(f"index {index} out of range for {count} samples in {self.path}")
        return position

    def _record(self, position: int, buffer: Any) -> Record:
        if buffer is None:
            raise PackError(f"{self.path}: record {position} is missing (corrupt pack)")
        record = decode_record(buffer, where=f"{self.path} record {position}")
        if record.label != self.targets[position]:
            raise PackError(f"{self.path}: record {position} disagrees with the label index")
        return record

    def _decoded(self, position: int, buffer: Any) -> tuple[Any, int]:
        record = self._record(position, buffer)
        return decode_image(
            record, self.decode, where=f"{self.path} record {position}"
        ), record.label


def decode_image(record: Record, mode: str, where: str = "record") -> Any:
    """Turn a record's payload into a PIL RGB image, a uint8 CHW tensor, a HWC array or bytes.

    Stored image files are converted to RGB as packing converts them (``formats.images.to_rgb``:
    like torchvision's loader, except that 16-bit images are scaled rather than clipped).

    The result never refers to the file's memory, so it outlives the read transaction.

    Raises:
        PackError: naming ``where`` if an encoded payload is not a decodable image.
    """
    if mode == "bytes":
        return bytes(record.payload)
    if record.kind is RecordKind.RAW:
        pixels = np.frombuffer(record.payload, dtype=np.uint8).reshape(record.shape)
        if mode == "tensor":
            return _chw_tensor(pixels)
        pixels = pixels.copy()
        if mode == "numpy":
            return pixels
        return Image.fromarray(pixels if pixels.shape[2] != 1 else pixels[:, :, 0])
    with _decoding(where):
        image = Image.open(io.BytesIO(record.payload))
        image.load()  # inside the read transaction, and so that errors surface here
        image = to_rgb(image)
    if mode == "pil":
        return image
    if mode == "numpy":
        return np.array(image)
    return _chw_tensor(np.asarray(image))


def _chw_tensor(pixels: np.ndarray) -> torch.Tensor:
    # One copy, from the (read-only) HWC pixels straight into a writable CHW array.
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


@contextmanager
def _decoding(where: str) -> Iterator[None]:
    try:
        yield
    except (OSError, SyntaxError, ValueError) as error:  # what PIL raises for a bad image
        raise PackError(f"{where}: stored image does not decode ({error})") from error


class PackWriter:
    """Base of the packed-file writers: records in, one pack file out, complete at ``close()``.

    Args:
        path: the file to write (must not exist).
        store: the store mode recorded in the metadata ("encoded", "raw" or "jpeg").
        classes: class names, indexed by label.
        info: extra JSON-able facts to keep in the metadata (source, options, ...).

    The ``store``, ``classes`` and ``info`` attributes are read when ``close()`` writes the
    metadata, so a caller can still add what it learns while writing (such as a skipped count).
    Subclasses implement ``_open``, ``append``, ``close`` and ``abort``.

    Raises:
        FileExistsError: if ``path`` exists.
        TypeError: if ``info`` holds something JSON cannot.
    """

    backend = ""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        store: str,
        classes: Sequence[str],
        info: dict | None = None,
    ) -> None:
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{self.path}: already exists")
        self.store = store
        self.classes = list(classes)
        self.info = dict(info or {})
        self.count = 0  # records appended so far
        self.bytes_written = 0
        self.metadata_json()  # fail before writing anything if the metadata cannot be stored
        self._open()

    def _open(self) -> None:
        """Create the file at ``path`` and whatever writing needs."""
        raise NotImplementedError

    def metadata_json(self) -> bytes:
        """The metadata, as JSON, of the records appended so far."""
        return dump_metadata(
            make_metadata(self.backend, self.store, self.count, self.classes, self.info)
        )

    def append(self, record: bytes, label: int) -> None:
        """Add the next record (index ``count``) with its label."""
        raise NotImplementedError

    def close(self) -> None:
        """Write what is left and the metadata, last: the pack is then complete."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close without metadata: the file never opens as a complete pack."""
        raise NotImplementedError

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
