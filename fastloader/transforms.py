"""Device transforms: cheap per-batch work done on the GPU after the copy.

Moving uint8 images and converting on the device copies a quarter of the bytes of float32
images and takes the conversion off the CPU workers. Pass a transform as
``DevicePrefetcher(..., transform=...)`` or ``DataLoader(..., device_transform=...)``; on CUDA it
runs on the prefetcher's side stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Normalize"]


class Normalize:
    """Convert uint8 images to float and normalize them per channel.

    ``out = (image / 255 - mean) / std``, with ``mean`` and ``std`` on the 0-1 scale as in
    torchvision (for ImageNet: ``mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)``).

    What it applies to:
        - a tensor of shape ``(N, C, H, W)`` or ``(C, H, W)``: that tensor;
        - a tuple or list (including a namedtuple), such as ``(images, labels)``: its first
          element, which must be such a tensor; the other elements are passed through unchanged
          and the container type is kept.

    Args:
        mean: per-channel means, one per channel (or a single value for all channels).
        std: per-channel standard deviations, same length as ``mean``, none of them zero.
        dtype: the floating dtype of the output (``torch.float32``, ``float16``, ``bfloat16``).
        channels_last: return 4-D batches in ``torch.channels_last`` memory format (the
            conversion is fused with the dtype cast). 3-D images are left contiguous.

    Raises:
        ValueError: if ``mean``/``std`` are empty, of different lengths, or ``std`` has a zero.
        TypeError: if ``dtype`` is not a floating dtype.
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
    ) -> None:
        mean = tuple(float(m) for m in mean)
        std = tuple(float(s) for s in std)
        if not mean or not std:
            raise ValueError("mean and std must each have at least one value")
        if len(mean) != len(std):
            raise ValueError(
                f"mean and std must have the same length, got {len(mean)} and {len(std)}"
            )
        if any(s == 0.0 for s in std):
            raise ValueError(f"std must not contain zeros, got {std}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.mean = mean
        self.std = std
        self.dtype = dtype
        self.channels_last = bool(channels_last)
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, batch: Any) -> Any:
        """Normalize ``batch`` (a tensor, or the first element of a tuple/list).

        Raises:
            TypeError: if the images are not a uint8 tensor, or ``batch`` is another type.
            ValueError: if the images are not 3-D/4-D or their channel count does not match.
        """
        if isinstance(batch, torch.Tensor):
            return self._normalize(batch)
        if isinstance(batch, (tuple, list)) and batch:
            items = [self._normalize(batch[0]), *batch[1:]]
            if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
                return type(batch)(*items)
            try:
                return type(batch)(items)
            except TypeError:
                return tuple(items) if isinstance(batch, tuple) else items
        raise TypeError(
            "Normalize applies to an image tensor or to the first element of a tuple/list "
            f"batch, got {type(batch).__name__}"
        )

    def _normalize(self, images: Any) -> torch.Tensor:
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
            kind = images.dtype if isinstance(images, torch.Tensor) else type(images).__name__
            raise TypeError(f"Normalize expects uint8 images (0-255), got {kind}")
        if images.dim() not in (3, 4):
            raise ValueError(
                "Normalize expects images of shape (N, C, H, W) or (C, H, W), "
                f"got shape {tuple(images.shape)}"
            )
        channels = images.shape[-3]
        if len(self.mean) not in (1, channels):
            raise ValueError(
                f"Normalize has {len(self.mean)} mean/std values but the images have "
                f"{channels} channels (shape {tuple(images.shape)})"
            )
        scale, shift = self._constants(images.device)
        if self.channels_last and images.dim() == 4:
            out = images.to(self.dtype, memory_format=torch.channels_last)
        else:
            out = images.to(self.dtype)
        # (x / 255 - mean) / std  ==  x * (1 / (255 * std)) + (-mean / std)
        return out.mul_(scale).add_(shift)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        constants = self._cache.get(device)
        if constants is None:
            mean = torch.tensor(self.mean, dtype=torch.float64)
            std = torch.tensor(self.std, dtype=torch.float64)
            scale = (1.0 / (255.0 * std)).to(self.dtype).view(-1, 1, 1)
            shift = (-mean / std).to(self.dtype).view(-1, 1, 1)
            scale, shift = scale.to(device), shift.to(device)
            if device.type == "cuda":
                # Created once; make sure the copies have landed before any stream (the
                # prefetcher's side stream included) reads them. See NOTE [ Side-stream copy
                # and record_stream ] in fastloader/device.py.
                torch.cuda.current_stream(device).synchronize()
            constants = self._cache[device] = (scale, shift)
        return constants

    def __repr__(self) -> str:
        return (
            f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, "
            f"channels_last={self.channels_last})"
        )
