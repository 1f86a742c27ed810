"""Damaged packs laid out by columns (format 5): byte flips and truncations, read in a child.

The harness of ``benchmarks/fuzz.py`` (issue 10's table) on packs of fields made by
``fastloader.pack``: 160 dict samples of a raw 48x48x3 image (fixed), float32 keypoints
(fixed), ragged float32 boxes and int64 labels, a name (str, padded to one width), a ragged
note (str) and a score (float), in blocks of 32 rows. Each damaged copy is opened, every
sample read one by one (the per-sample path) and every batch of 16 read by column and
collated as ``fastloader.DataLoader`` does in its main process (``read_batch_columns``, then
the default collate; each batch twice), and compared with the original; outcomes as
fuzz.py's: a trial is correct when every sample and every batch row is
the original's or a ``PackError``.

Run: ``python -m benchmarks.fuzz_columns [--trials 500] [--seed 0] [--kinds flip,truncate]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from benchmarks.fuzz import OUTCOMES, classify, damage, run_trials

BACKENDS = {"lmdb": ".lmdb", "hdf5": ".h5"}
COUNT = 160
BATCH = 16


class Samples:
    """The packed samples: fixed and ragged fields of every kind a column holds."""

    def __len__(self) -> int:
        return COUNT

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng(index)
        boxes = rng.random((index % 7, 4)).astype(np.float32)
        return {
            "image": rng.integers(0, 256, (48, 48, 3), np.uint8),
            "keypoints": rng.random((17, 2)).astype(np.float32),
            "boxes": boxes,
            "labels": rng.integers(0, 80, len(boxes)).astype(np.int64),
            "name": f"img{index:05d}.jpg",
            "note": "x" * (index % 11),
            "score": float(index) / 3,
        }


def make_pack(path: Path) -> Path:
    from fastloader import pack

    pack(Samples(), path, schema={"image": "image"}, store="raw", workers=0)
    return path


def _digest(sample: dict) -> str:
    parts = []
    for name in sorted(sample):
        value = sample[name]
        if hasattr(value, "numpy"):  # a tensor
            value = value.numpy()
        if isinstance(value, np.ndarray):
            parts.append(f"{name}:{value.dtype.str}:{value.shape}:")
            parts.append(xxhash.xxh3_64_hexdigest(np.ascontiguousarray(value).tobytes()))
        else:
            parts.append(f"{name}:{type(value).__name__}:{value!r}")
    return xxhash.xxh3_64_hexdigest("|".join(parts).encode())


def _batch_rows(dataset, start: int) -> list:
    """A batch read by column, its fixed fields made into tensors as the loader's default
    collate makes them in the main process (mapped rows gathered into the batch tensor, names from
    the decoded text cache: NOTE [ Gathered into the batch tensor ], NOTE [ Text columns
    decoded once ]), a digest per row; read twice, so that a row is also read from what the
    first read kept."""
    from fastloader.datasets.collate import default_collate, whole
    from fastloader.datasets.columns import ColumnBatch

    indices = list(range(start, min(start + BATCH, len(dataset))))
    rows = []
    for _ in range(2):
        columns = dataset.read_batch_columns(indices).columns
        tensors = ColumnBatch({n: c for n, c in columns.items() if whole(c)}, len(indices))
        batch = {**columns, **default_collate(tensors)}  # ragged fields: the values as read
        rows.append(
            [_digest({name: batch[name][at] for name in batch}) for at in range(len(indices))]
        )
    return rows[0] if rows[0] == rows[1] else ["other: a second read differs"] * len(indices)


def read_all(path: str) -> dict:
    """Every sample one by one, then every batch by column: a summary to compare."""
    from fastloader import PackError, open_pack

    try:
        dataset = open_pack(path)
    except (PackError, FileNotFoundError):
        return {"open": "PackError"}
    except Exception as error:  # noqa: BLE001 - what we are looking for
        return {"open": f"other: {type(error).__name__}: {error}"[:300]}
    result = {"open": "ok", "length": len(dataset), "classes": list(dataset.classes)}
    samples: list = []
    for index in range(len(dataset)):
        try:
            samples.append(_digest(dataset[index]))
        except PackError:
            samples.append("PackError")
        except Exception as error:  # noqa: BLE001
            samples.append(f"other: {type(error).__name__}: {error}"[:300])
    for start in range(0, len(dataset), BATCH):
        rows = min(BATCH, len(dataset) - start)
        try:
            samples += _batch_rows(dataset, start)
        except PackError:
            samples += ["PackError"] * rows
        except Exception as error:  # noqa: BLE001
            samples += [f"other: {type(error).__name__}: {error}"[:300]] * rows
    result["samples"] = samples
    return result


def fuzz(workdir: Path, backend: str, trials: int, kind: str, seed: int) -> dict[str, int]:
    """Count the outcomes of ``trials`` damaged copies of one pack."""
    original = workdir / f"orig{BACKENDS[backend]}"
    if not original.exists():
        make_pack(original)
    expected = read_all(str(original))
    assert all(sample != "PackError" for sample in expected["samples"])
    data = original.read_bytes()
    rng = np.random.default_rng(seed)
    counts = dict.fromkeys(OUTCOMES, 0)
    for first in range(0, trials, 100):  # a hundred files on disk at a time
        paths = []
        for trial in range(first, min(first + 100, trials)):
            path = workdir / f"{kind}-{trial}{BACKENDS[backend]}"
            path.write_bytes(damage(data, rng, kind))
            paths.append(path)
        for result in run_trials(paths, module_args=("benchmarks.fuzz_columns", "--child")):
            counts[classify(expected, result)] += 1
        for path in paths:
            path.unlink()
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_columns")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="flip,truncate")
    parser.add_argument("--backends", default="lmdb,hdf5")
    args = parser.parse_args(argv)
    if args.child:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(read_all(line.strip())), flush=True)
        return
    print("| pack (columns) | damage | trials | " + " | ".join(OUTCOMES) + " |")
    print("|---|---|---|" + "---|" * len(OUTCOMES))
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends.split(","):
            for kind in args.kinds.split(","):
                started = time.perf_counter()
                counts = fuzz(Path(workdir), backend, args.trials, kind, args.seed)
                cells = " | ".join(str(counts[name]) for name in OUTCOMES)
                what = "3 random byte flips" if kind == "flip" else "truncation"
                print(
                    f"| {backend.upper()} | {what} | {args.trials} | {cells} |"
                    f"  ({time.perf_counter() - started:.0f} s, load "
                    f"{os.getloadavg()[0]:.1f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
