"""Lightning helpers: a DataModule over packed files, and a callback that logs how long
training waited for data (imports ``lightning`` when imported).

Example::

    from fastloader.lightning import PackedDataModule

    data = PackedDataModule("train.lmdb", val="val.lmdb", batch_size=256, train_transform=tf)
    trainer.fit(model, datamodule=data)

Under Lightning's DDP strategy nothing else is needed: Lightning rebuilds each loader with its
own ``DistributedSampler`` (``fastloader.DataLoader`` keeps its extra arguments when rebuilt) and
fastloader calls ``set_epoch`` on it every epoch. The loaders' ``state_dict`` goes into
checkpoints, so a run resumed from a mid-epoch checkpoint continues with the same samples (on
the same number of devices). Pass ``distributed=True`` (a ``**loader_kwargs``) for fastloader's
global order instead, which Lightning keeps: its checkpoints then resume on any number of
devices, and ``shuffle=False`` evaluation sees each sample exactly once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from fastloader.datasets.packs import PackedDataset, open_pack
from fastloader.formats import read_metadata
from fastloader.loader.dataloader import DataLoader
from fastloader.stats.downloads import DownloadStats
from fastloader.stats.timing import EpochStats

PathLike = str | os.PathLike


class PackedDataModule(pl.LightningDataModule):
    """Train/val/test/predict ``fastloader.DataLoader``s over packs made by ``fastloader-pack``.

    Args:
        train, val, test, predict: paths of LMDB or HDF5 packs (any may be None).
        batch_size: samples per batch for every loader.
        num_workers: workers per loader (int, or "auto"). Each loader keeps its workers for the
            whole run, so train and val workers both stay alive: size this accordingly.
        train_transform: applied to training images; ``eval_transform`` to the others.
        decode: how images are decoded ("pil", "tensor", "numpy"; see ``LMDBDataset``).
        seed: seed of the training order and augmentations; None follows ``seed_everything``.
        **loader_kwargs: any other ``fastloader.DataLoader`` argument (``pin_memory``,
            ``drop_last``, ``collate_fn``...), given to every loader.

    Raises:
        ValueError: if no path is given.
        FileNotFoundError, fastloader.PackError: when a pack is missing or not readable
            (checked at construction, not after the first training epoch).
    """

    def __init__(
        self,
        train: PathLike | None = None,
        val: PathLike | None = None,
        test: PathLike | None = None,
        predict: PathLike | None = None,
        *,
        batch_size: int = 32,
        num_workers: int | str = "auto",
        train_transform: Callable | None = None,
        eval_transform: Callable | None = None,
        decode: str = "pil",
        seed: int | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__()
        self.paths = {"train": train, "val": val, "test": test, "predict": predict}
        if not any(self.paths.values()):
            raise ValueError("PackedDataModule needs at least one of train, val, test, predict")
        for path in self.paths.values():
            if path is not None:
                read_metadata(path)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_transform = train_transform
        self.eval_transform = eval_transform
        self.decode = decode
        self.seed = seed
        self.loader_kwargs = loader_kwargs
        self._loaders: dict[str, DataLoader] = {}

    @property
    def classes(self) -> list[str]:
        """Class names of the first pack given (train, else val, test, predict)."""
        path = next(p for p in self.paths.values() if p is not None)
        return list(read_metadata(path)["classes"])

    def dataset(self, split: str) -> PackedDataset:
        """Open the pack of ``split`` ("train", "val", "test" or "predict") with its transform."""
        path = self.paths[split]
        if path is None:
            raise ValueError(f"PackedDataModule was given no {split} pack")
        transform = self.train_transform if split == "train" else self.eval_transform
        return open_pack(path, transform=transform, decode=self.decode)

    def _loader(self, split: str) -> DataLoader:
        # One loader per split for the whole run, so its workers start once.
        if split not in self._loaders:
            self._loaders[split] = DataLoader(
                self.dataset(split),
                batch_size=self.batch_size,
                shuffle=split == "train",
                num_workers=self.num_workers,
                seed=self.seed,
                **self.loader_kwargs,
            )
        return self._loaders[split]

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")

    def teardown(self, stage: str) -> None:
        """Stop every loader's workers when Lightning is done with the module."""
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()


class LoaderStatsMonitor(pl.Callback):
    """Logs, after each training epoch, how long training waited for data.

    For every ``fastloader.DataLoader`` among the trainer's training loaders it logs, through
    ``LightningModule.log`` (so to every logger of the trainer), ``{prefix}wait_fraction`` (0-1:
    the share of the epoch spent blocked on data, ``iter()`` and the epoch's first batch
    included), ``{prefix}samples_per_s`` and, when the workers report it,
    ``{prefix}worker_busy`` (0-1), and for a ``fastloader.Mix`` the realised share of each
    source in the epoch, ``{prefix}source_share/{name}`` (0-1). For a dataset that downloads
    shards (a ``ShardedDataset`` of a URL) it also logs the epoch's downloads (``loader.stats``'
    ``DownloadStats``, NOTE [ Download stats ] in stats/downloads.py) under
    ``{prefix}downloads/``: ``wait_share`` (0-1: the share of the loading processes' time spent
    waiting for downloads), ``wait_s``, ``hit_rate`` (0-1), ``shards``, ``bytes``, ``requests``,
    ``evictions``, ``bytes_per_s`` and ``requests_per_s`` (for an epoch cut short by
    ``limit_train_batches``, until the monitor logs them); other datasets log none of them.
    With several training loaders the name of each (its key or position) follows the prefix.
    Other loaders are skipped. See docs/diagnosis.md.

    Example::

        trainer = lightning.Trainer(callbacks=[LoaderStatsMonitor(verbose=True)])

    Args:
        prefix: prepended to each metric name.
        verbose: also print each epoch's one-line diagnosis (``LoaderStats.summary``) on rank 0:
            with downloads, their figures, and the advice when readers waited for them.
    """

    def __init__(self, prefix: str = "data/", verbose: bool = False) -> None:
        super().__init__()
        self.prefix = prefix
        self.verbose = verbose

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = _named_loaders(trainer.train_dataloader)
        metrics: dict[str, float] = {}
        for name, loader in loaders:
            epoch = _epoch_of(loader)
            if epoch is None:
                continue
            key = self.prefix + (f"{name}/" if len(loaders) > 1 else "")
            metrics |= {key + figure: value for figure, value in _figures(epoch).items()}
            if self.verbose:
                from lightning.pytorch.utilities import rank_zero_info

                rank_zero_info(f"fastloader {name}: {epoch.summary()}")
        if metrics:
            pl_module.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1)


def _named_loaders(loaders: Any) -> list[tuple[str, DataLoader]]:
    """The fastloader loaders in whatever Lightning holds (a loader, a list, a dict), named."""
    if isinstance(loaders, DataLoader):
        return [("train", loaders)]
    if isinstance(loaders, dict):
        items = list(loaders.items())
    elif isinstance(loaders, (list, tuple)):
        items = list(enumerate(loaders))
    else:
        return []
    return [(str(name), loader) for name, loader in items if isinstance(loader, DataLoader)]


def _figures(epoch: EpochStats) -> dict[str, float]:
    """An epoch's figures, named as logged after the prefix (``LoaderStatsMonitor``)."""
    figures = {"wait_fraction": epoch.wait_fraction, "samples_per_s": epoch.samples_per_s}
    busy = epoch.worker_busy_fraction
    if busy is not None:
        figures["worker_busy"] = busy
    for source, share in (epoch.source_shares or {}).items():  # a fastloader.Mix
        figures[f"source_share/{source}"] = share
    if epoch.downloads is not None:  # a ShardedDataset of a URL
        for figure, value in _download_figures(epoch.downloads).items():
            figures[f"downloads/{figure}"] = value
    return figures


def _download_figures(downloads: DownloadStats) -> dict[str, float]:
    """What a user charts of an epoch's downloads, as floats (Lightning logs floats)."""
    figures = {
        "wait_share": downloads.wait_share,
        "wait_s": downloads.wait_s,
        "hit_rate": downloads.hit_rate,
        "shards": downloads.downloads,
        "bytes": downloads.bytes_downloaded,
        "requests": downloads.requests,
        "evictions": downloads.evictions,
        "bytes_per_s": downloads.bytes_per_s,
        "requests_per_s": downloads.requests_per_s,
    }
    return {figure: float(value) for figure, value in figures.items()}


def _epoch_of(loader: DataLoader) -> EpochStats | None:
    """The epoch Lightning just trained on: the running one until now (an epoch cut short by
    ``limit_train_batches`` is not closed yet), else the last one ended."""
    current = loader.stats.current
    if current is not None and current.batches:
        return loader.stats.so_far()
    return loader.stats.last
