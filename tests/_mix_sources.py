"""Sources for the mix tests: sized datasets whose samples say who they are (and draw RNGs)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from fastloader import Mix


class Numbered(Dataset):
    """Sample i = tensor [i, a numpy draw, a random draw, a torch draw] (seeding visible)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        draws = [float(i), np.random.rand(), random.random(), torch.rand(1).item()]
        return torch.tensor(draws, dtype=torch.float64)


class Sized(Dataset):
    """Only a length (the order tests never load a sample)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


SIXTEEN = {f"s{i:02d}": int(n) for i, n in enumerate(np.geomspace(1e3, 1e6, 16))}
# generic weights (shares times 1000 are not integers, which would make windows easy)
WEIGHTS = {name: float(w) for name, w in zip(SIXTEEN, np.geomspace(4.0, 1.0, 16), strict=True)}
EQUAL = dict.fromkeys(SIXTEEN, 1.0)


def sixteen(schedule=None, seed=11, **kwargs) -> Mix:
    """16 sources of 10**3 to 10**6 samples, unequal weights; an epoch is two epochs of the
    largest source."""
    return Mix(
        {name: Sized(n) for name, n in SIXTEEN.items()},
        WEIGHTS,
        schedule=schedule,
        seed=seed,
        samples_per_epoch=2 * max(SIXTEEN.values()),
        **kwargs,
    )


def identities(mix: Mix, codes) -> list[tuple[str, int]]:
    """(source, index) of each code a mix sampler yielded."""
    out = []
    for code in codes:
        s, index = mix.order.decode(int(code))
        out.append((mix.order.names[s], index))
    return out


class DiesOnce(Numbered):
    """Numbered, but the first worker that loads sample ``fatal`` dies (SIGKILL): once, as a
    file records it."""

    def __init__(self, n: int, fatal: int, marker: str) -> None:
        super().__init__(n)
        self.fatal, self.marker = fatal, marker

    def __getitem__(self, i: int) -> torch.Tensor:
        import os
        import signal

        if i == self.fatal and torch.utils.data.get_worker_info() is not None:
            if not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)
