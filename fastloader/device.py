"""Batches onto the device: pinned host memory, side-stream copies, device transforms.

Everything here runs in the main (training) process. ``DevicePrefetcher`` wraps any iterable of
host batches and yields them already on the device, copied ``depth`` batches ahead on a side
stream so that the copies overlap the training step (see NOTE [ Side-stream copies ] for how
the two streams are kept in order), and ``Normalize``, the device transform that turns uint8
batches into normalized floats there.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["DevicePrefetcher", "Normalize", "move_to_device", "pin", "resolve_device"]

_SUPPORTED_TYPES = ("cpu", "cuda")


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """Check a ``device`` argument and turn it into a ``torch.device``.

    ``"cuda"`` without an index stays index-less: it means the current CUDA device at the time
    batches are copied, as it does for ``tensor.to("cuda")``.

    Args:
        device: ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.

    Returns:
        The ``torch.device``, or ``None`` when ``device`` is ``None``.

    Raises:
        TypeError: if ``device`` is not a str, a ``torch.device`` or ``None``.
        ValueError: if the string is not a device, or names a device type other than cpu/cuda.
        RuntimeError: for a CUDA device when CUDA is not available, or an index past the
            number of visible CUDA devices.
    """
    if device is None:
        return None
    if isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"device={device!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N'"
            ) from exc
    elif isinstance(device, torch.device):
        resolved = device
    else:
        raise TypeError(
            f"device must be a str, a torch.device or None, got {type(device).__name__}"
        )
    if resolved.type not in _SUPPORTED_TYPES:
        raise ValueError(
            f"device={str(resolved)!r} is not supported; expected 'cpu', 'cuda' or 'cuda:N'"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={str(resolved)!r} but torch.cuda.is_available() is False; "
                "install a CUDA build of torch on a machine with a GPU, or pass device=None "
                "(or 'cpu') to keep batches on the host"
            )
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise RuntimeError(
                f"device={str(resolved)!r} but only {count} CUDA device(s) are visible "
                f"(valid indices 0..{count - 1}; see CUDA_VISIBLE_DEVICES)"
            )
    return resolved


def move_to_device(batch: Any, device: str | torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``batch`` to ``device``, keeping the batch's structure.

    Handles what torch's default collate produces and a little more: tensors inside tuples,
    lists, namedtuples, mappings (their type kept when it can be) and dataclass instances
    (rebuilt with ``dataclasses.replace``). Other leaves (strings, numbers, ``None``, NumPy
    arrays) are passed through unchanged.

    Args:
        batch: a tensor or a nested structure holding tensors.
        device: where the tensors go.
        non_blocking: passed to ``Tensor.to``; asynchronous only from pinned host memory.

    Returns:
        A batch of the same structure whose tensors are on ``device``.
    """
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def pin(batch: Any) -> Any:
    """Copy every CPU tensor in ``batch`` into pinned (page-locked) host memory.

    Tensors already pinned, or not on the CPU, are kept as they are. Without CUDA there is no
    pinned memory: the batch is returned unchanged, as torch's DataLoader does with
    ``pin_memory=True`` on a machine without a GPU.

    Args:
        batch: a tensor or a nested structure holding tensors (see ``move_to_device``).

    Returns:
        A batch of the same structure whose CPU tensors are pinned.
    """
    if not torch.cuda.is_available():
        return batch
    return _map_tensors(batch, _pin_tensor)


def _pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor leaf of ``batch``, rebuilding its containers."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, tuple):
        items = [_map_tensors(item, fn) for item in batch]
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*items)
        return _rebuild(batch, items, tuple)
    if isinstance(batch, list):
        return _rebuild(batch, [_map_tensors(item, fn) for item in batch], list)
    if isinstance(batch, Mapping):
        return _map_mapping(batch, fn)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [field.name for field in dataclasses.fields(batch) if field.init]
        return dataclasses.replace(
            batch, **{name: _map_tensors(getattr(batch, name), fn) for name in fields}
        )
    return batch


def _map_mapping(batch: Mapping, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``_map_tensors`` of a mapping: a copy of its type where it can be made."""
    if isinstance(batch, MutableMapping):
        # A shallow copy keeps the mapping's type and its extras (a defaultdict's factory).
        try:
            clone = copy.copy(batch)
            for key, value in batch.items():
                clone[key] = _map_tensors(value, fn)
            return clone
        except TypeError:
            pass
    mapped = {key: _map_tensors(value, fn) for key, value in batch.items()}
    return _rebuild(batch, mapped, dict)


def _rebuild(original: Any, items: Any, fallback: type) -> Any:
    if type(original) is fallback:
        return fallback(items)
    try:
        return type(original)(items)
    except TypeError:
        return fallback(items)


def _tensor_leaves(batch: Any) -> list[torch.Tensor]:
    leaves: list[torch.Tensor] = []
    _map_tensors(batch, lambda tensor: leaves.append(tensor) or tensor)  # each leaf as it is
    return leaves


# NOTE [ Side-stream copies ]
#
# The training step runs on the consumer's current stream (usually the default stream). If the
# host-to-device copy ran there too, each step would wait for its own input copy. So the
# prefetcher copies on a dedicated side stream, `depth` batches ahead:
#
#   1. Pull a host batch, pin it (a non_blocking copy is only asynchronous from page-locked
#      memory; from pageable memory it silently synchronizes), and issue `.to(device,
#      non_blocking=True)` plus the device transform under `torch.cuda.stream(side)`. Then
#      record an event on the side stream. The host thread does not wait for any of it.
#      The side stream does NOT wait on the consumer stream first: the consumer has usually
#      queued a whole step of kernels already, and waiting for them would serialize the copy
#      behind the step, which is exactly the overlap we want.
#   2. When the batch is handed out, the consumer stream waits on that event
#      (`current_stream.wait_event(ev)`): kernels queued after this point by the training step
#      start only once the copy and transform are done. The host still does not block.
#   3. The batch's device memory was allocated while the side stream was current, so the
#      caching allocator considers it the side stream's. When the consumer drops the batch,
#      the allocator would hand the block to the next side-stream allocation at once, while
#      consumer kernels reading it may still be queued: the next copy would overwrite a batch
#      still in use. `tensor.record_stream(current_stream)` on every output tensor tells the
#      allocator to wait for the consumer's pending work before reusing the block.
#
# The pinned host batch is kept referenced until its event has been waited on, so its memory
# is not reused while the asynchronous copy still reads from it. (Torch's pinned-memory
# allocator also records the copy, but only for memory it allocated itself.)
#
# Device constants a transform creates (for example Normalize's mean and std) must be ready
# before the side stream reads them; see Normalize._constants below.
#
# Batches whose tensors are already on the CUDA device pass through the copy unchanged and are
# then read by the transform on the side stream; the producer of such tensors must have
# finished writing them (the prefetcher is meant for host batches).


class DevicePrefetcher:
    """Yield the batches of an iterable already on a device, copied ahead of use.

    On CUDA, host batches are pinned (when not already), copied with ``non_blocking=True`` on
    a side stream ``depth`` batches ahead, and ``transform`` runs on that stream too; each
    batch is ready for the consumer's current stream when it is handed out. See
    NOTE [ Side-stream copies ]. On the CPU, batches are only passed through
    ``transform``, with the same ordering.

    When batch ``k`` is handed out, batches up to ``k + depth`` have been pulled from the
    iterable and their copies issued, so the prefetcher keeps at most ``depth`` batches on the
    device besides the ones the consumer holds. Each ``iter(prefetcher)`` starts a new pass
    over ``iter(iterable)``, so one prefetcher serves every epoch.

    Args:
        iterable: any iterable of batches (tensors or structures of tensors), for example a
            DataLoader.
        device: the target device (see ``resolve_device``).
        depth: how many batches are copied ahead; at least 1.
        transform: a callable applied to each batch on the device (on the side stream for
            CUDA), for example ``fastloader.device.Normalize``.

    Raises:
        TypeError: if ``depth`` is not an int or ``device`` has a wrong type.
        ValueError: if ``depth`` is less than 1, or ``device`` is ``None`` or not a device.
        RuntimeError: for a CUDA device without CUDA.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        device: str | torch.device,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"depth must be an int, got {depth!r}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable or None, got {transform!r}")
        resolved = resolve_device(device)
        if resolved is None:
            raise ValueError("device must be given (for example 'cuda'), got None")
        self.iterable = iterable
        self.device = resolved
        self.depth = depth
        self.transform = transform
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.iterable)
        if self.device.type != "cuda":
            return _PrefetchIterator(source, self.device, self.depth, self.transform, None)
        device = self.device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return _PrefetchIterator(source, device, self.depth, self.transform, stream)

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (
            f"DevicePrefetcher({self.iterable!r}, device={str(self.device)!r}, "
            f"depth={self.depth}, transform={self.transform!r})"
        )


# NOTE [ Errors keep their place ]
#
# The prefetcher pulls `depth` batches ahead, so when the source raises (a sample failed to
# load, a transform failed), batches pulled before the failure are still queued. Raising at
# once would hand the error out early, before batches that come before it in the order; a
# caller that counts what it consumed (the loader's resume position) would then count those
# batches as skipped. So a failure takes its place in the queue like a batch: the batches
# before it are handed out first, then it is raised, then the pass continues with the
# source's later batches (a source that can go on after an error, as a DataLoader iterator
# does after a dataset error, loses nothing). Filling stops at a queued failure, so nothing is
# pulled past it until it has been raised. The end of the source (StopIteration) is kept the
# same way: it is raised only once the queue is empty. KeyboardInterrupt and other
# BaseExceptions are not failures of one batch: they propagate at once.


class _Raised:
    """A failure of the source (or of a batch's copy) kept in its place in the queue."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class _PrefetchIterator:
    """One pass of a DevicePrefetcher: a queue of batches whose copies have been issued."""

    def __init__(
        self,
        source: Iterator[Any],
        device: torch.device,
        depth: int,
        transform: Callable[[Any], Any] | None,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._source: Iterator[Any] | None = source
        self._device = device
        self._depth = depth
        self._transform = transform
        self._stream = stream
        # (device batch, ready event or None, host batch kept alive until the event is waited),
        # or a _Raised failure in its place; see NOTE [ Errors keep their place ]
        self._queue: deque[tuple[Any, Any, Any] | _Raised] = deque()

    def __iter__(self) -> _PrefetchIterator:
        return self

    def __next__(self) -> Any:
        queue = self._queue
        while self._source is not None and len(queue) <= self._depth:
            if queue and isinstance(queue[-1], _Raised):
                break  # pull nothing past a failure until it has been raised
            try:
                host = next(self._source)
            except StopIteration:
                self._source = None
                break
            except Exception as error:
                queue.append(_Raised(error))
                break
            try:
                queue.append(self._issue(host))
            except Exception as error:
                queue.append(_Raised(error))
                break
        if not queue:
            raise StopIteration
        entry = queue.popleft()
        if isinstance(entry, _Raised):
            error, entry.error = entry.error, None  # type: ignore[assignment]
            try:
                raise error
            finally:
                del error  # no cycle error -> traceback -> this frame -> error
        batch, ready, _host = entry
        if ready is not None:
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(ready)
            for tensor in _tensor_leaves(batch):
                if tensor.is_cuda:
                    tensor.record_stream(consumer)
        return batch

    def _issue(self, host: Any) -> tuple[Any, Any, Any]:
        """Start moving one host batch to the device (and transforming it)."""
        if self._stream is None:
            batch = move_to_device(host, self._device)
            if self._transform is not None:
                batch = self._transform(batch)
            return batch, None, None
        host = pin(host)
        with torch.cuda.stream(self._stream):
            batch = move_to_device(host, self._device, non_blocking=True)
            if self._transform is not None:
                batch = self._transform(batch)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return batch, ready, host


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
                # prefetcher's side stream included) reads them. See
                # NOTE [ Side-stream copies ].
                torch.cuda.current_stream(device).synchronize()
            constants = self._cache[device] = (scale, shift)
        return constants

    def __repr__(self) -> str:
        return (
            f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, "
            f"channels_last={self.channels_last})"
        )


# --- torchvision-named image transforms ---------------------------------------------------------
