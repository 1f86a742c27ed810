"""A GPU training step fed by each way of getting batches onto the device.

The same step (normalize uint8 224x224 images on the device, a small conv net, cross-entropy,
backward, SGD) runs on:

- ``synthetic``: one batch already on the device, reused: the upper bound;
- ``prefetcher``: ``DevicePrefetcher`` (side-stream copies, Normalize on the side stream) over a
  torch DataLoader with ``pin_memory=True``;
- ``fastloader``: ``fastloader.DataLoader(..., device="cuda", device_transform=Normalize)``;
- ``torch_pin_cuda``: torch's DataLoader with ``pin_memory=True`` and ``.cuda(non_blocking=True)``
  in the loop, as most training scripts do.

Steps/s and the ratio of each to ``synthetic`` are reported (the goal is >= 0.95 where the
CPU side keeps up: the data here is in memory, so it does). Without CUDA the comparison is
skipped. Run alone: ``python -m benchmarks --only gpu_step``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from benchmarks._stats import significant
from fastloader.device import DevicePrefetcher
from fastloader.vision.transforms import Normalize

SIZES = {
    #        batch, image side, warm-up steps, timed steps
    "tiny": (16, 64, 3, 10),
    "quick": (128, 224, 10, 60),
    "full": (256, 224, 20, 200),
}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLASSES = 1000
SKIPPED = {"comparison": "gpu_step", "skipped": "no CUDA device", "rows": [], "ratios": {}}


class InMemoryImages(Dataset):
    """``n`` samples drawn from a small pool of random uint8 CHW images (a copy per sample)."""

    def __init__(self, n: int, side: int, pool: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.n = n
        self.images = torch.randint(0, 256, (pool, 3, side, side), dtype=torch.uint8,
                                    generator=generator)  # fmt: skip
        self.labels = torch.randint(0, CLASSES, (n,), generator=generator)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index % len(self.images)].clone(), int(self.labels[index])


def _model(device: torch.device, weight: str) -> nn.Module:
    """A small conv net; ``heavy`` adds four 128-channel convolutions at 56x56.

    NOTE [ Light and heavy steps ]: the light step runs ~36k samples/s on an H100, faster than
    any CPU-side loader here can feed 150 KB samples, so its ratios measure the producers, not
    the copy path. The heavy step is slow enough for the CPU side to keep up; its ratios show
    what the goal (>= 0.95 of on-device speed) is about: whether the copies overlap the step.
    """
    layers: list[nn.Module] = [
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(32, 128, 3, stride=2, padding=1), nn.ReLU(inplace=True),
    ]  # fmt: skip
    if weight == "heavy":
        for _ in range(4):
            layers += [nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(inplace=True)]
    layers += [
        nn.Conv2d(128, 128, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, CLASSES),
    ]  # fmt: skip
    return nn.Sequential(*layers).to(device, memory_format=torch.channels_last)


def _trainer(device: torch.device, weight: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = _model(device, weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps_per_s(
    batches: Iterable[Any],
    prepare: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    warmup: int,
    steps: int,
    weight: str,
) -> float:
    """Time ``steps`` training steps after ``warmup`` ones, over one pass of ``batches``.

    ``weight`` "none" times the batches alone (no step): the feeding rate.
    """
    step = _trainer(device, weight) if weight != "none" else (lambda images, labels: None)
    started = 0.0
    done = 0
    for batch in batches:
        if done == warmup:
            _sync(device)
            started = time.perf_counter()
        step(*prepare(batch))
        done += 1
        if done == warmup + steps:
            break
    _sync(device)
    if done < warmup + steps:
        raise RuntimeError(f"the loader ran out after {done} of {warmup + steps} batches")
    return steps / (time.perf_counter() - started)


def _compare(size: str, device: torch.device) -> dict:
    batch, side, warmup, steps = SIZES[size]
    workers = max(1, min(8, (os.cpu_count() or 2) - 2))
    dataset = InMemoryImages(batch * (warmup + steps), side)
    normalize = Normalize(MEAN, STD, channels_last=True)
    pin = device.type == "cuda"

    def torch_loader() -> TorchDataLoader:
        return TorchDataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                               pin_memory=pin, drop_last=True)  # fmt: skip

    def already_there(pair: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return pair

    def copy_in_loop(pair: Any) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = pair
        images = images.to(device, non_blocking=True)
        return normalize(images), labels.to(device, non_blocking=True)

    def normalize_in_loop(pair: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return normalize(pair[0]), pair[1]

    images, labels = next(iter(torch_loader()))
    resident = (images.to(device), labels.to(device))
    fastloader_loader = _fastloader_loader(dataset, batch, workers, device, normalize)

    def runs(weight: str) -> dict[str, Callable[[], float]]:
        def timed(batches: Iterable[Any], prepare: Callable) -> Callable[[], float]:
            return lambda: _steps_per_s(batches(), prepare, device, warmup, steps, weight)

        chosen: dict[str, Callable[[], float]] = {}
        if weight != "none":
            chosen["synthetic"] = timed(
                lambda: (resident for _ in range(warmup + steps)), normalize_in_loop
            )
        chosen["prefetcher"] = timed(
            lambda: DevicePrefetcher(torch_loader(), device, depth=2, transform=normalize),
            already_there,
        )
        chosen["torch_pin_cuda"] = timed(torch_loader, copy_in_loop)
        if fastloader_loader is not None:
            chosen["fastloader"] = timed(lambda: fastloader_loader, already_there)
        return chosen

    rows = []
    for weight in ("none", "light", "heavy"):
        reference = None
        for name, measure in runs(weight).items():
            rate = measure()
            reference = reference or rate
            row = {"step": weight, "loader": name, "steps_per_s": round(rate, 2),
                   "samples_per_s": round(rate * batch, 1)}  # fmt: skip
            row["vs_synthetic"] = significant(rate / reference) if weight != "none" else None
            rows.append(row)
    notes = [
        "uint8 images normalized on the device; goal: ratios >= 0.95 where the CPU side keeps up",
        "step 'none': batches on the device with no training step, i.e. the feeding rate; the "
        "light step is faster than that feeding rate on a fast GPU (input-bound), the heavy one "
        "is not (see NOTE [ Light and heavy steps ])",
    ]
    if fastloader_loader is not None:
        notes.append(f"fastloader stats: {fastloader_loader.stats.summary()}")
        fastloader_loader.close()
    return {
        "comparison": "gpu_step",
        "config": {"batch_size": batch, "image": [3, side, side], "num_workers": workers,
                   "warmup_steps": warmup, "timed_steps": steps, "device": str(device)},
        "rows": rows,
        "ratios": {f"{row['loader']}_{row['step']}_vs_synthetic": row["vs_synthetic"]
                   for row in rows if row["vs_synthetic"] is not None
                   and row["loader"] != "synthetic"},
        "notes": notes,
    }  # fmt: skip


def _fastloader_loader(
    dataset: Dataset, batch: int, workers: int, device: torch.device, normalize: Normalize
) -> Any:
    """``fastloader.DataLoader`` copying to ``device``, or None if it cannot (yet)."""
    try:
        from fastloader import DataLoader

        return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                          drop_last=True, device=device, device_transform=normalize)  # fmt: skip
    except (ImportError, TypeError):
        return None


def run(size: str, workdir: Path) -> dict:
    """Run the GPU-step comparison at ``size`` ("tiny", "quick", "full").

    ``workdir`` is unused (the data is generated in memory); it is accepted for the runner.
    Without CUDA, returns a result marked ``skipped`` with no rows.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if not torch.cuda.is_available():
        return dict(SKIPPED)
    return _compare(size, torch.device("cuda", torch.cuda.current_device()))
