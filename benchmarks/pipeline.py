"""The training pipeline: random-resized crop 224 + flip to uint8 CHW batches, every loader.

The headline comparison. On the same photos (~500x375 JPEGs, ``_photos.py``), batches of 64,
two workers (or threads) each, interleaved rounds, medians:

- torch's DataLoader over the image folder (persistent workers), the PIL transform;
- fastloader.DataLoader over the same folder dataset, the same PIL transform;
- fastloader.ImageFolder with the fused transform (NOTE [ Fused decoding ]);
- fastloader over LMDB packs (``encoded``, ``jpeg`` short side 256, ``raw`` short side 256),
  each with the plain PIL transform and with the fused one;
- NVIDIA DALI on the CPU (``fn.decoders.image_random_crop`` + ``fn.resize`` +
  ``fn.crop_mirror_normalize``) and SPDL (a thread pipeline with the same PIL transform),
  skipped with a reason when not installed (``pip install nvidia-dali-cuda120 spdl``).

The rate is steady samples/s: from the end of each epoch's first ``SKIP_BATCHES`` batches to its
last batch, of an epoch that follows an untimed one of the same loader (NOTE [ An untimed epoch
first ]).

Run alone: ``python -m benchmarks --only pipeline [--size full]``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader

from benchmarks._photos import ImageFolderDataset, image_folder, packed
from benchmarks._progress import advance, note, plan
from benchmarks._stats import paired_ratio, rotated, significant
from fastloader import DataLoader, ImageFolder, LMDBDataset
from fastloader import transforms as T

SIZES = {
    #        photos, batch, rounds
    "tiny": (96, 16, 1),
    "quick": (384, 32, 5),
    "full": (2000, 64, 5),
}
#: The loaders of the quick demo (``--quick``): the headline and its baselines, with enough
#: rounds for a stable ratio in under a minute; the other sizes run every loader.
DEMO_LOADERS = ("torch_folder", "fastloader_imagefolder_fused", "lmdb_raw_fused", "dali_cpu")
PEER_PACKAGES = {"dali_cpu": "nvidia-dali-cuda120", "spdl": "spdl"}
#: What each loader is, for people (the summary, the plot).
LABELS = {
    "torch_folder": "torch DataLoader, image folder, PIL transform",
    "fastloader_folder": "fastloader.DataLoader, same folder and transform",
    "fastloader_imagefolder_fused": "fastloader.ImageFolder, fused transform",
    "lmdb_encoded_plain": "LMDB pack (encoded), PIL transform",
    "lmdb_encoded_fused": "LMDB pack (encoded), fused",
    "lmdb_jpeg_plain": "LMDB pack (jpeg, short side 256), PIL transform",
    "lmdb_jpeg_fused": "LMDB pack (jpeg, short side 256), fused",
    "lmdb_raw_plain": "LMDB pack (raw, short side 256), PIL transform",
    "lmdb_raw_fused": "LMDB pack (raw, short side 256), fused",
    "dali_cpu": "NVIDIA DALI on CPU, fused random-crop decode",
    "spdl": "SPDL, threads, PIL transform",
}
WORKERS = 2
SKIP_BATCHES = 5  # 2 workers x prefetch 2, + 1
CROP = 224


def train_transform() -> T.Compose:
    """The ImageNet training transform: random-resized crop, flip, uint8 CHW."""
    return T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.PILToTensor()])


class Unfused:
    """Wraps a transform so no dataset fuses it: the plain PIL path (picklable)."""

    def __init__(self, transform: Callable) -> None:
        self.transform = transform

    def __call__(self, image: Any) -> Any:
        return self.transform(image)


def _torch_loader(dataset: Any, batch: int) -> TorchDataLoader:
    return TorchDataLoader(
        dataset, batch_size=batch, shuffle=True, num_workers=WORKERS, persistent_workers=True
    )


def _fast_loader(dataset: Any, batch: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=WORKERS, seed=0)


def _loaders(
    root: Path, workdir: Path, batch: int, only: tuple[str, ...] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """Name -> factory of an iterable of ``(images, labels)`` batches; and skipped peers.

    ``only``: the names to make (packs are made only for those); None: all.
    """
    wanted = (lambda name: True) if only is None else (lambda name: name in only)
    plain, fused = Unfused(train_transform()), train_transform()
    loaders: dict[str, Any] = {
        "torch_folder": lambda: _torch_loader(ImageFolderDataset(root, plain), batch),
        "fastloader_folder": lambda: _fast_loader(ImageFolderDataset(root, plain), batch),
        "fastloader_imagefolder_fused": lambda: _fast_loader(ImageFolder(root, fused), batch),
    }
    for store, side in (("encoded", None), ("jpeg", 256), ("raw", 256)):
        kinds = [k for k in ("plain", "fused") if wanted(f"lmdb_{store}_{k}")]
        if not kinds:
            continue
        note(f"packing the photos: LMDB --store {store}")
        path = packed(root, workdir, "lmdb", store, side)
        for kind in kinds:
            transform = plain if kind == "plain" else fused
            loaders[f"lmdb_{store}_{kind}"] = lambda path=path, transform=transform: _fast_loader(
                LMDBDataset(path, transform=transform), batch
            )
    loaders = {name: factory for name, factory in loaders.items() if wanted(name)}
    skipped = {}
    for name, factory in (("dali_cpu", _dali), ("spdl", _spdl)):
        if not wanted(name):
            continue
        try:
            loaders[name] = factory(root, batch, plain)
        except ImportError:
            skipped[name] = f"not installed (pip install {PEER_PACKAGES[name]})"
    return loaders, skipped


def _dali(root: Path, batch: int, transform: Callable) -> Callable[[], Any]:
    from nvidia.dali import fn, pipeline_def, types

    count = len(ImageFolderDataset(root).samples)

    @pipeline_def(batch_size=batch, num_threads=WORKERS, device_id=None, seed=0)
    def training_pipeline():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
        )
        images = fn.resize(images, resize_x=CROP, resize_y=CROP)
        images = fn.crop_mirror_normalize(
            images, dtype=types.UINT8, output_layout="CHW", mirror=fn.random.coin_flip()
        )
        return images, labels

    class DaliEpochs:
        def __init__(self) -> None:
            self.pipe = training_pipeline()
            self.pipe.build()

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for _ in range(-(-count // batch)):
                images, labels = self.pipe.run()
                yield (
                    torch.from_numpy(np.array(images.as_tensor())),
                    torch.from_numpy(np.array(labels.as_tensor())).flatten(),
                )

    return DaliEpochs


def _spdl(root: Path, batch: int, transform: Callable) -> Callable[[], Any]:
    from spdl.pipeline import PipelineBuilder

    dataset = ImageFolderDataset(root, transform)

    def collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([image for image, _ in samples]), torch.tensor([y for _, y in samples])

    class SpdlEpochs:
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            order = torch.randperm(len(dataset)).tolist()
            pipeline = (
                PipelineBuilder()
                .add_source(order)
                .pipe(dataset.__getitem__, concurrency=WORKERS)
                .aggregate(batch)
                .pipe(collate)
                .add_sink(3)
                .build(num_threads=WORKERS)
            )
            with pipeline.auto_stop():
                yield from pipeline.get_iterator(timeout=120)

    return SpdlEpochs


# NOTE [ An untimed epoch first ]
# A persistent pool goes on loading while the other loaders are timed: fastloader's workers
# load the next epoch ahead (cross-epoch prefetch, as deep as the batch's bytes allow), and a
# short epoch (the quick demo's 12 batches) could be in memory, whole, before its turn: its
# "steady" time was near zero (124x and 1270x torch in one demo run at 384 photos). Skipping
# a fixed number of first batches cannot follow a depth that varies. So each turn runs an
# untimed epoch, then the timed one right after it: what the pool loaded ahead of the timed
# epoch, it loaded while its own previous epoch ran, as in training. The first turn's untimed
# epoch is also the warm-up (workers started, files opened, pipelines built).


def _steady_rate(loader: Any, skip: int) -> float:
    """One epoch; samples/s after its first ``skip`` batches."""
    samples, started = 0, None
    for index, (images, _) in enumerate(loader):
        if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, CROP, CROP):
            raise AssertionError(f"unexpected batch {images.dtype} {tuple(images.shape)}")
        if index == skip - 1:
            started = time.perf_counter()
        elif started is not None:
            samples += len(images)
    if started is None or samples == 0:
        raise ValueError(f"an epoch needs more than {skip} batches")
    return samples / (time.perf_counter() - started)


def run(size: str, workdir: Path) -> dict:
    """Run the pipeline comparison at ``size`` ("tiny", "quick", "full")."""
    photos, batch, rounds = SIZES[size]
    skip = 2 if size == "tiny" else SKIP_BATCHES
    note(f"making {photos} photos")
    root = image_folder(workdir, photos)
    factories, skipped = _loaders(
        root, Path(workdir), batch, DEMO_LOADERS if size == "quick" else None
    )
    loaders = {name: factory() for name, factory in factories.items()}
    names = list(loaders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    plan(rounds * len(names))
    for round_ in range(rounds):
        note(f"round {round_ + 1} of {rounds}")
        for name in rotated(names, round_):
            _steady_rate(loaders[name], skip)  # NOTE [ An untimed epoch first ]
            rates[name].append(_steady_rate(loaders[name], skip))
            advance()
    for loader in loaders.values():
        if hasattr(loader, "close"):
            loader.close()
    del loaders
    median = {name: statistics.median(values) for name, values in rates.items()}

    def vs(name: str, base: str) -> float:
        return paired_ratio(rates[name], rates[base])

    rows = [
        {
            "loader": name,
            "what": LABELS.get(name, name),
            "samples_per_s": round(rate, 1),
            "vs_torch": significant(vs(name, "torch_folder")),
            "vs_dali": significant(vs(name, "dali_cpu")) if "dali_cpu" in median else None,
        }
        for name, rate in median.items()
    ]
    for row in rows:
        if row["vs_dali"] is None:
            del row["vs_dali"]
    others = [name for name in rates if name != "torch_folder"]
    ratios = {f"{name}_vs_torch": vs(name, "torch_folder") for name in others}
    if "dali_cpu" in median:
        for name in ("fastloader_imagefolder_fused", "lmdb_encoded_fused", "lmdb_raw_fused"):
            if name in rates:  # the quick demo runs fewer loaders
                ratios[f"{name}_vs_dali"] = vs(name, "dali_cpu")
    return {
        "comparison": "pipeline",
        "config": {
            "photos": photos,
            "batch_size": batch,
            "workers_or_threads": WORKERS,
            "rounds": rounds,
            "transform": repr(train_transform()).replace("\n", ""),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        },
        "rows": rows,
        "samples_per_s": rates,
        "ratios": ratios,
        "peers_skipped": skipped or None,
        "notes": [
            f"steady samples/s per epoch after its first {skip} batches; median of "
            f"{rounds} interleaved rounds, each loader's timed epoch right after an untimed one "
            "of its own (the first is the warm-up); ratios (vs_torch, vs_dali) "
            "are medians of the per-round ratios",
            f"{photos} photos (~500x375 JPEG), batches of {batch}, {WORKERS} workers or threads "
            "each" + ("; the quick demo runs the headline loaders only" if size == "quick" else ""),
            "plain = the PIL transform (as torchvision's); fused = the same transform planned "
            "from the JPEG header (DCT-scaled decode, one resize)",
        ]
        + [f"{name} skipped: {why}" for name, why in skipped.items()],
    }
