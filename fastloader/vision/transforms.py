"""Transforms with torchvision's names and semantics, and the device transform ``Normalize``.

``Compose``, ``RandomResizedCrop``, ``Resize``, ``CenterCrop``, ``RandomHorizontalFlip`` and
``PILToTensor`` take the same arguments as torchvision's, draw their random parameters the same
way from torch's default generator (which fastloader.DataLoader seeds per sample, see NOTE
[ Seeding contract ]) and give the same pixels: on a PIL image they call Pillow exactly as
torchvision does; on a uint8 tensor ``(..., C, H, W)`` they use ``torch.nn.functional.interpolate``
(bilinear, antialiased) as torchvision does; a NumPy array (``H x W`` or ``H x W x C``) goes
through Pillow and comes back as an array. They mix with any callable in ``Compose``.

Given one of these as its transform, a pack (``LMDBDataset``, ``HDF5Dataset``) or
``fastloader.ImageFolder`` fuses the leading crops/resizes/flips with decoding: see
NOTE [ Fused decoding ] in ``fastloader/vision/decoding.py``.

``Normalize`` is a device transform: cheap per-batch work done on the GPU after the copy.
Moving uint8 images and converting on the device copies a quarter of the bytes of float32
images and takes the conversion off the CPU workers. Pass it as
``DevicePrefetcher(..., transform=...)`` or ``DataLoader(..., device_transform=...)``; on CUDA it
runs on the prefetcher's side stream.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastloader.device import Normalize  # a device transform, kept importable from here

__all__ = [
    "CenterCrop",
    "Compose",
    "Normalize",
    "PILToTensor",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
]


_PIL_RESAMPLE = {
    "nearest": Image.NEAREST,
    "bilinear": Image.BILINEAR,
    "bicubic": Image.BICUBIC,
}


def _interpolation(value: Any) -> str:
    """Accept "bilinear"/"bicubic"/"nearest", a PIL resample constant or an InterpolationMode."""
    name = getattr(value, "value", value)  # torchvision's InterpolationMode is a str Enum
    if isinstance(name, str) and name.lower() in _PIL_RESAMPLE:
        return name.lower()
    for key, resample in _PIL_RESAMPLE.items():
        if not isinstance(name, str) and name == resample:
            return key
    raise ValueError(f"interpolation must be one of {sorted(_PIL_RESAMPLE)}, got {value!r}")


def _pair(size: Any, what: str = "size") -> tuple[int, int]:
    """An int, or a sequence of one or two ints, as ``(height, width)``."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        pair = (int(size), int(size))
    elif isinstance(size, Sequence) and len(size) in (1, 2):
        pair = (int(size[0]), int(size[-1]))
    else:
        raise TypeError(f"{what} must be an int or a sequence of one or two ints, got {size!r}")
    if min(pair) <= 0:
        raise ValueError(f"{what} must be positive, got {size!r}")
    return pair


def image_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` of a PIL image, a ``(..., C, H, W)`` tensor or an ``H x W[ x C]`` array.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(image, Image.Image):
        return image.height, image.width
    if isinstance(image, torch.Tensor) and image.dim() >= 2:
        return int(image.shape[-2]), int(image.shape[-1])
    if isinstance(image, np.ndarray) and image.ndim in (2, 3):
        return int(image.shape[0]), int(image.shape[1])
    raise TypeError(
        "expected a PIL image, a (..., C, H, W) tensor or an H x W (x C) array, "
        f"got {type(image).__name__}"
    )


def _as_pil(image: Any) -> tuple[Image.Image, bool]:
    """A PIL image, and whether ``image`` was an array (to convert back)."""
    if isinstance(image, np.ndarray):
        return Image.fromarray(image), True
    return image, False


def _back(image: Image.Image, was_array: bool) -> Any:
    return np.array(image) if was_array else image


def crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    """Crop as torchvision's ``F.crop`` (regions outside the image are zero-filled)."""
    if isinstance(image, torch.Tensor):
        image_h, image_w = image_size(image)
        if top < 0 or left < 0 or top + height > image_h or left + width > image_w:
            pads = [max(-left, 0), max(left + width - image_w, 0)]
            pads += [max(-top, 0), max(top + height - image_h, 0)]
            image = F.pad(image, pads)
            top, left = max(top, 0), max(left, 0)
        return image[..., top : top + height, left : left + width]
    pil, was_array = _as_pil(image)
    return _back(pil.crop((left, top, left + width, top + height)), was_array)


def resize(image: Any, size: tuple[int, int], interpolation: str = "bilinear") -> Any:
    """Resize to exactly ``size`` = ``(height, width)`` as torchvision (antialiased)."""
    if isinstance(image, torch.Tensor):
        if image_size(image) == size:
            return image
        shape = image.shape
        batch = image.reshape(-1, *shape[-3:]) if image.dim() >= 3 else image[None, None]
        dtype = batch.dtype
        if interpolation != "nearest" and dtype != torch.uint8 and not dtype.is_floating_point:
            batch = batch.float()
        out = F.interpolate(
            batch,
            size=size,
            mode=interpolation,
            antialias=interpolation != "nearest",
            **({} if interpolation == "nearest" else {"align_corners": False}),
        )
        if out.dtype != dtype:
            out = out.round_().clamp_(0, 255).to(dtype) if not dtype.is_floating_point else out
        return out.reshape(*shape[:-2], *size)
    pil, was_array = _as_pil(image)
    if (pil.height, pil.width) == size:
        return _back(pil, was_array)
    return _back(pil.resize((size[1], size[0]), _PIL_RESAMPLE[interpolation]), was_array)


def hflip(image: Any) -> Any:
    """Mirror left-right."""
    if isinstance(image, torch.Tensor):
        return image.flip(-1)
    if isinstance(image, np.ndarray):
        return np.ascontiguousarray(image[:, ::-1])
    return image.transpose(Image.FLIP_LEFT_RIGHT)


class Compose:
    """Apply ``transforms`` in order (torchvision's ``Compose``); any callables mix.

    Args:
        transforms: the callables, first applied first.
    """

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image

    def __repr__(self) -> str:
        inner = "".join(f"\n    {transform!r}," for transform in self.transforms)
        return f"Compose([{inner}\n])"


class Resize:
    """Resize to ``size`` (torchvision's ``Resize``, bilinear and antialiased by default).

    Args:
        size: an int: the shorter side becomes ``size`` and the longer keeps the aspect ratio
            (truncated, as torchvision); or ``(height, width)``.
        interpolation: "bilinear" (default), "bicubic" or "nearest" (or a PIL constant).
        max_size: with an int ``size``, the longest the longer side may be.
        antialias: accepted for compatibility; resizing is always antialiased, as torchvision's
            default.

    Raises:
        TypeError, ValueError: for a malformed ``size`` or ``max_size``, or an unknown
            interpolation.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        interpolation: Any = "bilinear",
        max_size: int | None = None,
        antialias: bool | None = True,
    ) -> None:
        self.size = size
        self._pair = _pair(size)
        self._shorter = isinstance(size, numbers.Integral) or len(size) == 1
        if max_size is not None and (not self._shorter or max_size <= self._pair[0]):
            raise ValueError(
                f"max_size ({max_size}) needs an int size smaller than it, got size={size!r}"
            )
        self.max_size = max_size
        self.interpolation = _interpolation(interpolation)
        self.antialias = antialias

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` this resize gives an image of ``height`` x ``width``."""
        if not self._shorter:
            return self._pair
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self._pair[0], int(self._pair[0] * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image: Any) -> Any:
        return resize(image, self.output_size(*image_size(image)), self.interpolation)

    def __repr__(self) -> str:
        return f"Resize(size={self.size}, interpolation={self.interpolation})"


class CenterCrop:
    """Crop the centre ``size`` (torchvision's ``CenterCrop``; zero-pads a smaller image).

    Args:
        size: an int for a square crop, or ``(height, width)``.

    Raises:
        TypeError, ValueError: for a malformed ``size``.
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size)

    def box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``(top, left, height, width)`` of the crop of a ``height`` x ``width`` image."""
        crop_h, crop_w = self.size
        return (
            int(round((height - crop_h) / 2.0)),
            int(round((width - crop_w) / 2.0)),
            crop_h,
            crop_w,
        )

    def __call__(self, image: Any) -> Any:
        return crop(image, *self.box(*image_size(image)))

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


class RandomResizedCrop:
    """Crop a random area and aspect ratio, resize it to ``size`` (torchvision's transform).

    The box is drawn exactly as torchvision's ``RandomResizedCrop.get_params`` draws it, from
    torch's default generator: the same seed gives the same box.

    Args:
        size: an int for a square output, or ``(height, width)``.
        scale: bounds of the crop's area as a fraction of the image's.
        ratio: bounds of the crop's aspect ratio (width / height), drawn log-uniformly.
        interpolation: "bilinear" (default), "bicubic" or "nearest" (or a PIL constant).
        antialias: accepted for compatibility (always antialiased, as torchvision's default).

    Raises:
        TypeError, ValueError: for a malformed ``size``, ``scale`` or ``ratio``, or an
            unknown interpolation.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: Any = "bilinear",
        antialias: bool | None = True,
    ) -> None:
        self.size = _pair(size)
        if len(scale) != 2 or len(ratio) != 2:
            raise ValueError(f"scale and ratio must be pairs, got {scale!r} and {ratio!r}")
        if scale[0] > scale[1] or ratio[0] > ratio[1] or min(*scale, *ratio) <= 0:
            raise ValueError(
                f"scale and ratio must be positive (min, max) pairs, got {scale!r}, {ratio!r}"
            )
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = _interpolation(interpolation)
        self.antialias = antialias

    @staticmethod
    def get_params(
        image: Any, scale: Sequence[float], ratio: Sequence[float]
    ) -> tuple[int, int, int, int]:
        """``(top, left, height, width)`` of a random crop of ``image``, as torchvision's."""
        return draw_crop_box(*image_size(image), scale, ratio)

    def __call__(self, image: Any) -> Any:
        top, left, height, width = draw_crop_box(*image_size(image), self.scale, self.ratio)
        return resize(crop(image, top, left, height, width), self.size, self.interpolation)

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"interpolation={self.interpolation})"
        )


def draw_crop_box(
    height: int, width: int, scale: Sequence[float], ratio: Sequence[float]
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` for an image of ``height`` x ``width``.

    Ten tries at a random area and log-uniform aspect ratio that fits, from torch's default
    generator (the same calls in the same order as torchvision), then a central crop.
    """
    area = height * width
    log_low, log_high = _log_bounds(tuple(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_low, log_high)).item()
        crop_w = int(round(math.sqrt(target_area * aspect_ratio)))
        crop_h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = torch.randint(0, height - crop_h + 1, size=(1,)).item()
            left = torch.randint(0, width - crop_w + 1, size=(1,)).item()
            return top, left, crop_h, crop_w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        crop_w, crop_h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        crop_h, crop_w = height, int(round(height * max(ratio)))
    else:
        crop_w, crop_h = width, height
    return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w


@functools.lru_cache(maxsize=16)
def _log_bounds(ratio: tuple[float, float]) -> tuple[float, float]:
    # torchvision's torch.log(torch.tensor(ratio)) (float32), once per ratio rather than per draw
    low, high = torch.log(torch.tensor(ratio)).tolist()
    return low, high


class RandomHorizontalFlip:
    """Mirror the image with probability ``p`` (torchvision's; draws ``torch.rand(1)``).

    Args:
        p: the probability of a flip.
    """

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def draw(self) -> bool:
        """Whether to flip this image: one draw from torch's default generator."""
        # torchvision's `torch.rand(1) < p` compares in float32; as Python floats, p rounded to
        # float32 gives the same answer for every draw, without building a comparison tensor.
        return torch.rand(1).item() < float(np.float32(self.p))

    def __call__(self, image: Any) -> Any:
        return hflip(image) if self.draw() else image

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class PILToTensor:
    """A PIL image (or ``H x W[ x C]`` uint8 array) as a uint8 ``C x H x W`` tensor.

    Like torchvision's, the result is a channels-first view of the pixels in ``H x W x C``
    order: collating a batch copies each image once, into the batch. A tensor passes through.

    Raises:
        TypeError: for anything else.
    """

    def __call__(self, image: Any) -> torch.Tensor:
        if isinstance(image, torch.Tensor):
            return image
        if isinstance(image, Image.Image):
            image = np.array(image)  # a writable copy, as torchvision
        if not isinstance(image, np.ndarray) or image.ndim not in (2, 3):
            raise TypeError(f"PILToTensor expects a PIL image or an array, got {type(image)}")
        if image.ndim == 2:
            image = image[:, :, None]
        if not image.flags.writeable:
            image = image.copy()
        return torch.from_numpy(image).permute(2, 0, 1)

    def __repr__(self) -> str:
        return "PILToTensor()"
