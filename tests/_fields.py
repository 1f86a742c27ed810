"""Data with many fields, made on the fly: a pose HDF5 file and a detection dataset."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
from PIL import Image

POSE_COUNT = 24
POSE_FIELDS = ("image", "part", "S", "imagename")


def make_pose_file(path: Path, count: int = POSE_COUNT, chunked: bool = True) -> Path:
    """The issue's pose file as h5py's ``create_dataset`` writes it: image N x H x W x 3 uint8,
    part N x 14 x 2 float32, S N x 14 x 3 float64, imagename N strings; with ``chunked``, also a
    gzip-compressed chunked ``labels/visible`` (N x 14 bool) in a group."""
    rng = np.random.default_rng(7)
    with h5py.File(path, "w") as file:
        file.create_dataset("image", data=rng.integers(0, 256, (count, 12, 10, 3), np.uint8))
        file.create_dataset("part", data=rng.random((count, 14, 2), np.float32) * 100)
        file.create_dataset("S", data=rng.random((count, 14, 3)))
        names = [f"im{index:05d}_é.jpg" for index in range(count)]
        file.create_dataset("imagename", data=names, dtype=h5py.string_dtype())
        if chunked:
            file.create_dataset(
                "labels/visible",
                data=rng.random((count, 14)) > 0.5,
                chunks=(5, 14),
                compression="gzip",
            )
    return path


def h5py_rows(path: Path, names) -> list[dict]:
    """Every sample as h5py reads it, one ``file[name][i]`` at a time (the reference)."""
    with h5py.File(path, "r") as file:
        count = len(file[names[0]])
        rows = []
        for index in range(count):
            row = {}
            for name in names:
                value = file[name][index]
                if isinstance(value, bytes):
                    value = value.decode()
                row[name] = value
            rows.append(row)
    return rows


def assert_same_sample(got: dict, want: dict) -> None:
    assert list(got) == list(want) or set(got) == set(want)
    for name, value in want.items():
        if isinstance(value, str):
            assert got[name] == value, name
        else:
            assert np.array_equal(np.asarray(got[name]), np.asarray(value)), name
            assert np.asarray(got[name]).dtype == np.asarray(value).dtype, name


class Detection:
    """image (PIL) + 0..50 float32 boxes + int64 class ids + a str file name, per sample."""

    def __init__(self, count: int = 12) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng(index)
        boxes = (rng.random((index * 37 % 51, 4)) * 100).astype(np.float32)
        return {
            "image": Image.fromarray(rng.integers(0, 256, (20, 24, 3), np.uint8)),
            "boxes": boxes,
            "labels": rng.integers(0, 80, len(boxes)).astype(np.int64),
            "name": f"img_{index}.jpg",
        }


class Indexed:
    """``n`` samples of two fields whose values name their index: ``x`` a ``side`` x ``side``
    int32 array of it, ``y`` the index (what every shard test follows a sample by)."""

    def __init__(self, n: int, side: int = 16) -> None:
        self.n, self.side = n, side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full((self.side, self.side), i, np.int32), "y": i}
