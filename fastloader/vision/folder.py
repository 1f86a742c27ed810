"""ImageFolder: torchvision's image-folder dataset, with fused decoding and compact indexes."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from fastloader.vision.decoding import fuse
from fastloader.vision.images import IMG_EXTENSIONS, check_jpeg_scans, class_folder_files, to_rgb

__all__ = ["IMG_EXTENSIONS", "ImageFolder"]


#: The file suffixes torchvision's ImageFolder loads (compared case-insensitively).
class ImageFolder(Dataset):
    """Images in ``root/<class>/**/<file>``, labelled by class folder, as torchvision's ImageFolder.

    The same ``classes`` (sorted folder names), ``class_to_idx``, ``samples`` (``(path, label)``
    in ``sorted(os.walk(..., followlinks=True))`` order, names sorted) and ``targets``.
    Differences, all for speed:

    - a ``transform`` starting with ``fastloader.vision.transforms`` crops/resizes is fused with
      decoding (NOTE [ Fused decoding ] in fastloader/vision/decoding.py): a JPEG is decoded at the
      smallest DCT scale its crop needs; other files decode in full;
    - the paths live in one NumPy byte buffer and ``targets`` is an int64 array, not Python
      lists, so forked workers do not copy them page by page (copy-on-write) as they read;
      ``samples`` is built as a list when asked for;
    - images become RGB as torchvision's loader and fastloader's packs make them
      (``images.to_rgb``: ``convert("RGB")``), so a folder and its pack give the same pixels;
    - bombs are refused before decoding: Pillow's ``Image.MAX_IMAGE_PIXELS`` for every
      transform (and none), and progressive JPEGs with more than ``images.MAX_JPEG_SCANS``
      scans (see docs/decoding-safety.md).

    Args:
        root: the folder of class folders.
        transform: applied to each image (a PIL RGB image, as torchvision's).
        target_transform: applied to each label.
        loader: ``loader(path) -> image`` replacing the built-in decoding (no fusing then).
        is_valid_file: ``is_valid_file(path) -> bool`` replacing the suffix check.
        allow_empty: accept class folders with no valid file.

    Raises:
        FileNotFoundError: if ``root`` has no class folder, or a class folder has no valid file
            (unless ``allow_empty``).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        loader: Callable[[str], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> None:
        self.root = os.fspath(root)
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader
        if loader is None:
            fuse(transform)  # planned here, so that the main process warns if on Pillow
        self.classes, self.class_to_idx = self.find_classes(self.root)
        paths, targets = _scan(self.root, self.class_to_idx, is_valid_file, allow_empty)
        encoded = [os.fsencode(path) for path in paths]
        self._offsets = np.cumsum([0] + [len(path) for path in encoded], dtype=np.int64)
        self._paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.targets = np.asarray(targets, dtype=np.int64)
        self.extensions = None if is_valid_file is not None else IMG_EXTENSIONS

    @staticmethod
    def find_classes(directory: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
        """The sorted class folder names in ``directory`` and their indices.

        Raises:
            FileNotFoundError: if there is none.
        """
        classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: index for index, name in enumerate(classes)}

    def path(self, index: int) -> str:
        """The file of sample ``index``."""
        start, end = self._offsets[index], self._offsets[index + 1]
        return os.fsdecode(self._paths[start:end].tobytes())

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``[(path, label), ...]`` as torchvision's (built on each access)."""
        return [(self.path(index), int(self.targets[index])) for index in range(len(self))]

    imgs = samples

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        """Load, decode and transform sample ``index``.

        Raises:
            IndexError: if ``index`` is out of range.
            OSError: naming the file, if it cannot be read or is not a decodable image
                (wherever Pillow, and so torchvision, fails on it: on every crop).
            PIL.Image.DecompressionBombError: naming the file, for a decompression bomb
                (``images.JPEGScanLimitError``, also an OSError, for a scan bomb).
        """
        count = len(self.targets)
        position = int(index) + count if int(index) < 0 else int(index)
        if not 0 <= position < count:
            raise IndexError(f"index {index} out of range for {count} samples in {self.root}")
        path = self.path(position)
        label: Any = int(self.targets[position])
        if self.loader is not None:
            image = self.loader(path)
            if self.transform is not None:
                image = self.transform(image)
        else:
            with open(path, "rb") as file:
                data = file.read()
            fused = fuse(self.transform)
            if fused is None:
                image = _decode(data, path)
                if self.transform is not None:
                    image = self.transform(image)
            else:
                image = fused.apply_encoded(data, lambda: _decode(data, path), "pil", path)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def pil_images_advice(self) -> str:
        """What turns these PIL images into tensors, for the collate's error (NOTE [ Advice
        that fits the dataset ] in fastloader/datasets/collate.py)."""
        if self.transform is None:
            return (
                "fastloader.ImageFolder gives PIL images, as torchvision's: pass a transform "
                "ending in fastloader.transforms.PILToTensor() (uint8 CxHxW; crops and resizes "
                "before it are fused with decoding) or torchvision's ToTensor()"
            )
        return (
            "this ImageFolder's transform returns PIL images: end it with "
            "fastloader.transforms.PILToTensor() (or torchvision's ToTensor())"
        )

    def __repr__(self) -> str:
        return (
            f"ImageFolder({self.root!r}, {len(self)} samples, {len(self.classes)} classes, "
            f"transform={self.transform!r})"
        )


def _decode(data: bytes, path: str) -> Image.Image:
    check_jpeg_scans(data, path)  # Pillow checks the pixel limit itself, in Image.open
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return to_rgb(image)
    except Image.DecompressionBombError as error:  # Pillow's class, naming the file
        raise type(error)(f"{path}: {error}") from error
    except (OSError, SyntaxError, ValueError) as error:
        raise OSError(f"{path}: not a decodable image ({error})") from error


def _scan(
    root: str,
    class_to_idx: dict[str, int],
    is_valid_file: Callable[[str], bool] | None,
    allow_empty: bool,
) -> tuple[list[str], list[int]]:
    """torchvision's ``make_dataset``: the valid files of each class folder, in its order."""
    if is_valid_file is None:

        def is_valid_file(path: str) -> bool:
            return path.lower().endswith(IMG_EXTENSIONS)

    paths, targets = [], []
    empty = []
    for name in sorted(class_to_idx):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue
        files = class_folder_files(folder, is_valid_file)
        paths += files
        targets += [class_to_idx[name]] * len(files)
        if not files:
            empty.append(name)
    if empty and not allow_empty:
        raise FileNotFoundError(
            f"Found no valid file for the classes {', '.join(empty)} in {root}. "
            f"Supported extensions are: {', '.join(IMG_EXTENSIONS)}"
        )
    return paths, targets
