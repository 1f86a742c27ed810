"""One batch equal to another: the same types, keys in the same order, dtypes, shapes, values."""

from __future__ import annotations

import numpy as np
import torch


def assert_same_batch(got, want, where="batch"):
    """Walks both batches; ``where`` names the place that differs."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same_batch(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for at, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_batch(g, w, f"{where}[{at}]")
    else:
        assert got == want, where
