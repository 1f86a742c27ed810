"""Small datasets for loader tests (importable by spawned workers)."""

import os
import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class RandomDraws(Dataset):
    """Sample i = [i, numpy draw, random draw, torch draw]; the worker pid is kept aside."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        draws = [float(i), np.random.rand(), random.random(), torch.rand(1).item()]
        return torch.tensor(draws, dtype=torch.float64), os.getpid()


class BatchedDraws(RandomDraws):
    """Has __getitems__: one numpy draw per batch, shared by its samples."""

    def __getitems__(self, indices):
        draw = np.random.rand()
        return [(torch.tensor([float(i), draw], dtype=torch.float64), os.getpid()) for i in indices]


class CountingStream(IterableDataset):
    """Yields (worker id, position, random draw), split across workers."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for position in range(worker, self.n, workers):
            yield torch.tensor([float(worker), float(position), np.random.rand()])


class FailsAt(Dataset):
    """Raises KeyError-free ValueError when loading `bad`."""

    def __init__(self, bad: int, n: int = 8) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode sample {i}")
        return i


class SlowStart(Dataset):
    """Pays `startup_s` the first time it is used in a process (like opening a big file)."""

    def __init__(self, n: int = 16, startup_s: float = 0.3) -> None:
        self.n, self.startup_s = n, startup_s
        self._opened_in = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if self._opened_in != os.getpid():
            time.sleep(self.startup_s)
            self._opened_in = os.getpid()
        return i


class RecordingSampler(torch.utils.data.Sampler):
    """A sequential sampler that records the epochs set on it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n
