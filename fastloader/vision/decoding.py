"""From a crop plan to pixels: decode only what the first crops/resizes of a transform keep.

NOTE [ Fused decoding ]
A training transform such as ``Compose([RandomResizedCrop(224), RandomHorizontalFlip(),
PILToTensor()])`` throws most decoded pixels away: it keeps one box of the image and shrinks it.
``fuse(transform)`` splits off the leading ``Resize`` / ``CenterCrop`` / ``RandomResizedCrop`` /
``RandomHorizontalFlip`` steps (and a ``PILToTensor`` right after them); for each sample:

1. read the JPEG header for the image's (height, width), without decoding;
2. walk the steps on that size, drawing their random parameters with the same calls, in the
   same order, as the unfused transforms (torch's default generator, seeded per sample by
   fastloader.DataLoader): the same seed gives the same box and flip as the plain transform;
   the result is one box in source pixels, an output size and a flip;
3. refuse bombs from the header, before any decoder allocates (NOTE [ Decompression bombs ]
   in fastloader/vision/images.py: Pillow's pixel limit, a cap on progressive scans), then decode
   every pixel at the smallest JPEG DCT scale (M/8) at which the box still has at least the
   output's pixels (``simplejpeg.decode_jpeg(min_height=, min_width=, min_factor=2)``:
   libjpeg-turbo, bundled in the wheel, releasing the GIL; strict, so damaged data fails here
   and goes to Pillow: NOTE [ Damaged data takes Pillow's verdict ]);
4. crop the box out of the decoded pixels and resize it once: at full scale, the box rounded
   to whole pixels (a NumPy view) and OpenCV's ``INTER_LINEAR`` (``INTER_AREA`` past 2x); at a
   reduced DCT scale, the exact sub-pixel box, smoothed as Pillow's bilinear filter smooths
   (NOTE [ Resampling a DCT-scaled decode ]); then flip;
5. hand the HWC uint8 result on as the unfused steps would have: a PIL image, or, where
   ``PILToTensor`` follows, a uint8 CHW tensor (contiguous: NOTE [ Channels-first once ]),
   then apply the remaining transforms.

Raw (pixel) records skip steps 1 and 3: the box is cropped from a view of the stored pixels,
so nothing is copied before the resize. Files that are not JPEGs (or CMYK JPEGs, which
libjpeg-turbo cannot turn into RGB) take the plain path: decode, then the whole transform. A
JPEG whose header reads but whose data simplejpeg rejects is decoded by Pillow instead and
given the geometry already drawn, so the random draws happen once either way.

NOTE [ Damaged data takes Pillow's verdict ]
A JPEG damaged inside its entropy-coded data (end marker intact) must fail on every path and
every crop where torchvision's loader (Pillow) fails, and give Pillow's pixels where Pillow
gives pixels. libjpeg reports most damage as a warning and fills in; Pillow raises only on its
fatal errors ("broken data stream", an OSError), and loads files with warnings (junk before a
marker, a bad ICC segment: valid photos). So the fused decode is strict (simplejpeg raises on
any libjpeg warning, having decoded every byte of the file, even at 1/8 scale), and whatever
it refuses is decoded by Pillow, whose error or pixels the sample gets. No path decodes less
than the whole file: a region decode (nvImageCodec's CPU decoder, used by earlier versions
when no DCT scale applies) stops at the crop's last row and reports no warnings, so it gave
garbage for damaged files, differently per crop (benchmarks/fuzz.py --scan-data). Checking
the file first costs about a full decode (a strict 1/8-scale decode of a 3000x2000 JPEG:
14 ms, the full decode 15 ms; region 3 ms), so the region decode was removed rather than
checked.

Why these libraries (timed on the benchmark photos, ~500x375, one core; see
benchmarks/pipeline.py for the loader-level comparison, benchmarks/fused_quality.py for
pixels against Pillow on small and large photos): Pillow decode + crop + resize 1.15 ms;
simplejpeg decode alone 0.54 ms; simplejpeg + cv2.resize 0.61 ms (49.7 dB PSNR vs Pillow);
+ Pillow's antialiased resize instead 1.10 ms; cv2.warpAffine (exact sub-pixel box) 0.71 ms;
cv2 INTER_AREA 0.82 ms. Without simplejpeg or OpenCV the same plan runs on Pillow (``draft``
for the DCT scale, ``resize(box=)``), same boxes, pixels within tolerance, and the first
transform fused in a process gives a ``PillowFallbackWarning`` naming ``fastloader[fast]``.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from fastloader.vision.images import check_image_limits, is_jpeg
from fastloader.vision.transforms import (
    CenterCrop,
    Compose,
    PILToTensor,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    draw_crop_box,
)

_MISSING = ""  # the fast backend's module that is not installed
try:  # the fast backend: both or neither
    import cv2
    import simplejpeg
except ImportError as error:  # pragma: no cover - exercised by forcing BACKEND in the tests
    cv2 = simplejpeg = None
    _MISSING = error.name or ""

__all__ = ["BACKEND", "FusedTransform", "Geometry", "PillowFallbackWarning", "fuse", "jpeg_size"]

#: "simplejpeg" (simplejpeg + OpenCV) when both are installed, else "pillow".
BACKEND = "simplejpeg" if simplejpeg is not None else "pillow"


class PillowFallbackWarning(UserWarning):
    """Fused decoding runs on Pillow, slower: OpenCV or simplejpeg is missing (once a process)."""


_fallback_warned: list[bool] = []  # once per process: when a transform is first fused


def _warn_fallback() -> None:
    if BACKEND == "pillow" and not _fallback_warned:
        _fallback_warned.append(True)
        missing = "OpenCV (cv2)" if _MISSING in ("", "cv2") else _MISSING
        message = f"fastloader: {missing} is not installed, so fused decoding runs on Pillow"
        fix = "slower: pip install fastloader[fast]"
        warnings.warn(PillowFallbackWarning(f"{message}, {fix}"), stacklevel=2)


_GEOMETRIC = (Resize, CenterCrop, RandomResizedCrop, RandomHorizontalFlip)


class Geometry(NamedTuple):
    """What the fused steps do to an image: a box in source pixels, resized, maybe flipped."""

    left: float
    top: float
    width: float
    height: float
    out_height: int
    out_width: int
    flip: bool


def jpeg_size(data: Any) -> tuple[int, int] | None:
    """``(height, width)`` of a JPEG that can be decoded to RGB fused, else None."""
    if not is_jpeg(bytes(data[:3])):
        return None
    try:
        if BACKEND == "simplejpeg":
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            return None if colorspace in ("CMYK", "YCCK") else (height, width)
        with Image.open(io.BytesIO(data)) as image:
            return (image.height, image.width) if image.mode in ("RGB", "L") else None
    except (ValueError, OSError):
        return None  # the plain path decodes it, and reports what is wrong


class FusedTransform:
    """A transform whose leading geometric steps are planned from the image size.

    Made by ``fuse``; datasets call ``apply_encoded`` or ``apply_raw`` per sample. Calling it
    on an image (``fused(image)``) is the original transform.
    """

    def __init__(self, transform: Callable, steps: Sequence, to_tensor: bool, rest: Sequence):
        self.transform = transform
        self.steps = tuple(steps)
        self.to_tensor = to_tensor
        self.rest = tuple(rest)

    def __call__(self, image: Any) -> Any:
        return self.transform(image)

    def draw(self, height: int, width: int) -> Geometry | None:
        """The geometry for an image of ``height`` x ``width``, drawing the steps' randomness.

        None (before any draw) when a step would pad the image: the plain path does that.
        """
        if self._pads(height, width):
            return None
        view_h, view_w = height, width
        left, top, box_w, box_h = 0.0, 0.0, float(width), float(height)
        flip = False
        for step in self.steps:
            if isinstance(step, Resize):
                view_h, view_w = step.output_size(view_h, view_w)
                continue
            if isinstance(step, RandomHorizontalFlip):
                flip ^= step.draw()
                continue
            if isinstance(step, CenterCrop):
                crop_top, crop_left, crop_h, crop_w = step.box(view_h, view_w)
                size = (crop_h, crop_w)
            else:
                crop_top, crop_left, crop_h, crop_w = draw_crop_box(
                    view_h, view_w, step.scale, step.ratio
                )
                size = step.size
            if flip:  # the box was drawn on the mirrored view
                crop_left = view_w - crop_left - crop_w
            scale_x, scale_y = box_w / view_w, box_h / view_h
            left += crop_left * scale_x
            top += crop_top * scale_y
            box_w, box_h = crop_w * scale_x, crop_h * scale_y
            view_h, view_w = size
        return Geometry(left, top, box_w, box_h, view_h, view_w, flip)

    def _pads(self, height: int, width: int) -> bool:
        for step in self.steps:
            if isinstance(step, Resize):
                height, width = step.output_size(height, width)
            elif isinstance(step, CenterCrop):
                if step.size[0] > height or step.size[1] > width:
                    return True
                height, width = step.size
            elif isinstance(step, RandomResizedCrop):
                height, width = step.size
        return False

    def apply_encoded(
        self, data: Any, decode_plain: Callable[[], Any], mode: str, where: Any = None
    ) -> Any:
        """Transform the image file ``data``; ``decode_plain()`` decodes it the plain way.

        Args:
            data: the file's bytes (any buffer).
            decode_plain: returns the decoded image as the dataset gives it to ``transform``
                (raising the dataset's error for a bad file, and Pillow's bomb checks).
            mode: what ``decode_plain`` returns: "pil", "tensor" (CHW) or "numpy" (HWC).
            where: the file or record, named in errors.

        Raises:
            PIL.Image.DecompressionBombError: for a JPEG over Pillow's pixel limit or with too
                many scans, before anything is decoded (NOTE [ Decompression bombs ]).
            Exception: what ``decode_plain`` raises for a file Pillow cannot decode.
        """
        size = jpeg_size(data)
        if size is not None:
            check_image_limits(data, size[1], size[0], where)
        geometry = None if size is None else self.draw(*size)
        if geometry is None:
            return self.transform(decode_plain())
        pixels = _decode_jpeg(data, geometry, *size)
        if pixels is None:  # libjpeg-turbo refused it: Pillow decodes, same geometry
            pixels = _apply_geometry(_as_hwc(decode_plain()), geometry)
        return self._finish(pixels, mode)

    def apply_raw(self, pixels: np.ndarray, mode: str) -> Any:
        """Transform uint8 HWC ``pixels`` (maybe read-only: only a crop of them is read)."""
        geometry = self.draw(pixels.shape[0], pixels.shape[1])
        if geometry is None:
            plain = {
                "pil": lambda: to_pil(pixels),
                "numpy": lambda: pixels.copy(),
                "tensor": lambda: torch.from_numpy(channels_first(pixels)),
            }[mode]
            return self.transform(plain())
        return self._finish(_apply_geometry(pixels, geometry), mode)

    def _finish(self, pixels: np.ndarray, mode: str) -> Any:
        """Hand the HWC result on as the unfused steps would, then apply the rest."""
        if self.to_tensor or mode == "tensor":
            image: Any = torch.from_numpy(channels_first(pixels))
        elif mode == "pil":
            image = to_pil(pixels)
        else:
            image = pixels
        for transform in self.rest:
            image = transform(image)
        return image

    def __repr__(self) -> str:
        return f"FusedTransform({self.transform!r})"


def fuse(transform: Callable | None) -> FusedTransform | None:
    """Split ``transform`` for fused decoding, or None when it does not start with a crop/resize.

    Fusable: a ``Compose`` (or a single transform) whose first steps are ``Resize``,
    ``CenterCrop``, ``RandomResizedCrop`` (bilinear) or ``RandomHorizontalFlip``, at least one
    of them a crop or resize.
    """
    if transform is None:
        return None
    cached = _CACHE.get(id(transform))
    if cached is not None and cached[0] is transform:
        return cached[1]
    steps = list(transform.transforms) if type(transform) is Compose else [transform]
    count = 0
    while count < len(steps) and _fusable(steps[count]):
        count += 1
    fused = None
    if any(not isinstance(step, RandomHorizontalFlip) for step in steps[:count]):
        to_tensor = count < len(steps) and type(steps[count]) is PILToTensor
        rest = steps[count + to_tensor :]
        fused = FusedTransform(transform, steps[:count], to_tensor, rest)
        _warn_fallback()
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[id(transform)] = (transform, fused)
    return fused


_CACHE: dict[int, tuple[Any, FusedTransform | None]] = {}


def _fusable(step: Any) -> bool:
    return type(step) in _GEOMETRIC and getattr(step, "interpolation", "bilinear") == "bilinear"


def _decode_jpeg(data: Any, geometry: Geometry, height: int, width: int) -> np.ndarray | None:
    """The geometry applied to a JPEG decoded at the smallest DCT scale that suffices."""
    min_height = math.ceil(geometry.out_height * height / geometry.height)
    min_width = math.ceil(geometry.out_width * width / geometry.width)
    if BACKEND == "pillow":
        return _pillow_jpeg(data, geometry, height, width, min_height, min_width)
    try:
        scaled = simplejpeg.decode_jpeg(
            data, min_height=min_height, min_width=min_width, min_factor=2
        )
    except ValueError:
        return None
    return _apply_geometry(scaled, geometry, height, width)


def _pillow_jpeg(
    data: Any, geometry: Geometry, height: int, width: int, min_height: int, min_width: int
) -> np.ndarray | None:
    try:
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (min_width, min_height))
        image = image.convert("RGB")
    except (OSError, ValueError, SyntaxError):
        return None
    return _pillow_geometry(image, geometry, image.width / width, image.height / height)


def _apply_geometry(
    pixels: np.ndarray, geometry: Geometry, height: int | None = None, width: int | None = None
) -> np.ndarray:
    """Crop, resize and flip HWC ``pixels``, which are the source scaled to its shape.

    ``height`` x ``width`` is the source size the geometry is in (default: ``pixels``'s).
    """
    scale_x = pixels.shape[1] / (width or pixels.shape[1])
    scale_y = pixels.shape[0] / (height or pixels.shape[0])
    if BACKEND == "pillow":
        channels = pixels.shape[2]
        image = Image.fromarray(pixels if channels != 1 else pixels[..., 0])
        return _pillow_geometry(image, geometry, scale_x, scale_y).reshape(
            geometry.out_height, geometry.out_width, channels
        )
    _one_thread_in_workers()
    if scale_x < 1.0 or scale_y < 1.0:  # a DCT-scaled decode
        out = _resample_exact(pixels, geometry, scale_x, scale_y)
        if geometry.flip:
            cv2.flip(out, 1, dst=out)
        return out.reshape(geometry.out_height, geometry.out_width, pixels.shape[2])
    # Full scale: round the box to whole pixels (at most half a source pixel off; none for
    # RandomResizedCrop, whose boxes are whole pixels).
    x0 = min(max(round(geometry.left * scale_x), 0), pixels.shape[1] - 1)
    y0 = min(max(round(geometry.top * scale_y), 0), pixels.shape[0] - 1)
    x1 = min(max(round((geometry.left + geometry.width) * scale_x), x0 + 1), pixels.shape[1])
    y1 = min(max(round((geometry.top + geometry.height) * scale_y), y0 + 1), pixels.shape[0])
    region = pixels[y0:y1, x0:x1]
    size = (geometry.out_width, geometry.out_height)
    shrink = max((x1 - x0) / size[0], (y1 - y0) / size[1])
    if region.shape[:2] == size[::-1]:
        out = np.array(region)  # own the pixels (the source may be a file's memory)
    else:
        interpolation = cv2.INTER_AREA if shrink > 2 else cv2.INTER_LINEAR
        out = cv2.resize(region, size, interpolation=interpolation)
    if geometry.flip:
        cv2.flip(out, 1, dst=out)  # in place
    return out.reshape(geometry.out_height, geometry.out_width, pixels.shape[2])


# NOTE [ Resampling a DCT-scaled decode ]
# Torchvision resizes the crop of the full decode with Pillow's bilinear filter, which, when
# shrinking by f, averages over a triangle 2f source pixels wide (it antialiases). After a DCT
# scale the box is a fractional rectangle of the scaled image and still shrinks by f in [1, 2)
# (more past the 1/8 scale). Rounding that box to whole scaled pixels moves it by up to half a
# scaled pixel (4 source pixels at 1/8), and ``INTER_LINEAR`` does not smooth: on 41 large
# photos (>= 1000 px short side) that gave a median 40.8 dB PSNR against torchvision's pixels,
# 10th percentile 32.8 (random-resized crops). Here the box is mapped exactly
# (``cv2.warpAffine`` with the sub-pixel affine map, Pillow's pixel-centre convention) after a
# Gaussian blur whose variance tops the interpolation's own up to the triangle's
# ((f^2 - 1) / 6 per axis): 47.7 dB median, 39.1 at the 10th percentile (Resize + CenterCrop:
# 46.6 / 37.1), for ~0.4 ms more per image than ``cv2.resize`` (the decodes take 4-200 ms);
# Pillow's ``resize(box=)`` on the same scaled decode scores about 1 dB more at three times the
# resample's cost. Full-scale decodes (the small photos' random crops) keep the
# cheaper rounded ``cv2.resize``. Figures: benchmarks/results/fused_quality.md.


def _resample_exact(
    pixels: np.ndarray, geometry: Geometry, scale_x: float, scale_y: float
) -> np.ndarray:
    """The geometry's box of ``pixels`` (scaled by ``scale_x``/``scale_y`` from the source),
    resampled to the output size with a sub-pixel map, smoothed as Pillow's bilinear filter.

    See NOTE [ Resampling a DCT-scaled decode ].
    """
    box_x, box_y = geometry.left * scale_x, geometry.top * scale_y
    shrink_x = geometry.width * scale_x / geometry.out_width
    shrink_y = geometry.height * scale_y / geometry.out_height
    sigma_x = math.sqrt(max(shrink_x * shrink_x - 1.0, 0.0) / 6.0)
    sigma_y = math.sqrt(max(shrink_y * shrink_y - 1.0, 0.0) / 6.0)
    kernel = (_kernel_size(sigma_x), _kernel_size(sigma_y))
    margin = 2 + max(kernel) // 2  # the blur's and the interpolation's reach past the box
    x0 = min(max(math.floor(box_x) - margin, 0), pixels.shape[1] - 1)
    y0 = min(max(math.floor(box_y) - margin, 0), pixels.shape[0] - 1)
    x1 = max(min(math.ceil(box_x + geometry.width * scale_x) + margin, pixels.shape[1]), x0 + 1)
    y1 = max(min(math.ceil(box_y + geometry.height * scale_y) + margin, pixels.shape[0]), y0 + 1)
    region = pixels[y0:y1, x0:x1]
    if kernel != (1, 1):
        region = cv2.GaussianBlur(
            region,
            kernel,
            sigmaX=max(sigma_x, 1e-3),
            sigmaY=max(sigma_y, 1e-3),
            borderType=cv2.BORDER_REPLICATE,
        )
    # Output pixel centre d maps to source box_x + (d + 0.5) * shrink_x - 0.5 (Pillow's map).
    matrix = np.array(
        [
            [shrink_x, 0.0, box_x - x0 + 0.5 * shrink_x - 0.5],
            [0.0, shrink_y, box_y - y0 + 0.5 * shrink_y - 0.5],
        ]
    )
    out = cv2.warpAffine(
        region,
        matrix,
        (geometry.out_width, geometry.out_height),
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )
    return out if out.ndim == 3 else out[..., None]


def _kernel_size(sigma: float) -> int:
    """An odd Gaussian kernel size reaching 3 sigma; 1 (no blur) for a negligible sigma."""
    return 1 if sigma <= 0.15 else 2 * math.ceil(3.0 * sigma) + 1


_threads_set_in: int | None = None


def _one_thread_in_workers() -> None:
    """In a DataLoader worker, run OpenCV on one thread, as torch runs itself there.

    Workers are already one per core: OpenCV's own thread pool would only contend with them.
    The main process (``num_workers=0``) keeps the user's OpenCV setting.
    """
    global _threads_set_in
    pid = os.getpid()
    if _threads_set_in != pid:
        _threads_set_in = pid
        if get_worker_info() is not None:
            # 0, not 1: "run sequentially". setNumThreads(1) tears down the thread pool the
            # child inherited from a parent that used it (our own blur/warp with
            # num_workers=0, or the user's OpenCV calls) and deadlocks on its condition
            # variables; 0 does not.
            cv2.setNumThreads(0)


def _pillow_geometry(
    image: Image.Image, geometry: Geometry, scale_x: float, scale_y: float
) -> np.ndarray:
    box = (
        geometry.left * scale_x,
        geometry.top * scale_y,
        (geometry.left + geometry.width) * scale_x,
        (geometry.top + geometry.height) * scale_y,
    )
    size = (geometry.out_width, geometry.out_height)
    image = image.resize(size, Image.BILINEAR, box=box)
    if geometry.flip:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = np.array(image)
    return pixels if pixels.ndim == 3 else pixels[..., None]


def to_pil(pixels: np.ndarray) -> Image.Image:
    """uint8 HWC pixels as a PIL image (mode L for one channel, RGB or RGBA otherwise)."""
    return Image.fromarray(pixels if pixels.shape[2] != 1 else pixels[..., 0])


def channels_first(pixels: np.ndarray) -> np.ndarray:
    """HWC pixels as a contiguous CHW array of their own (never a view of ``pixels``).

    NOTE [ Channels-first once ]
    ``PILToTensor`` returns a CHW *view* of HWC pixels (as torchvision's), and collating such
    views into a batch is a transposing copy: ~44 us per 224x224 image, 14x a plain copy
    (benchmarked with ``torch.stack`` on one core). OpenCV's ``split`` de-interleaves into a
    CHW array in ~5 us, after which the batch copy is a plain one (~3 us).
    """
    height, width, channels = pixels.shape
    if BACKEND == "pillow":
        return pixels.transpose(2, 0, 1).copy()
    planes = np.empty((channels, height, width), dtype=np.uint8)
    cv2.split(pixels, list(planes))
    return planes


def _as_hwc(image: Any) -> np.ndarray:
    """A decoded image (PIL, CHW tensor or HWC array) as a uint8 HWC array."""
    if isinstance(image, Image.Image):
        pixels = np.asarray(image)
        return pixels if pixels.ndim == 3 else pixels[..., None]
    if isinstance(image, torch.Tensor):
        return image.permute(1, 2, 0).numpy()
    return image
