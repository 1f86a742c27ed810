"""Damaged sharded packs: one shard's bytes flipped or cut, the whole epoch read in a child.

A sharded pack (``fastloader.pack(..., shard_size=...)``) of 96 dict samples: a raw 16x16x3
uint8 ``img`` (fixed), float32 ``kp`` (fixed), ragged float32 ``boxes``, a ``name`` (text,
unique: it says which sample a row is) and an int ``label``; LMDB and HDF5, laid out by
``columns`` (format 5) or ``records`` (format 4). Each trial links the clean shards into a
folder of its own and writes one damaged copy of one shard: 3 byte flips (half of them within
the shard's first or last 4 KB: headers, meta pages, column tables, metadata), or a truncation
with the manifest's size and digest made to match (else the size check alone refuses it). A
child reads the epoch through ``fastloader.DataLoader`` (``shuffle=True`` or a
``ShardOrderSampler``, batches of 10 that cut shards; every other trial through a ``Mix`` with
a clean local pack), then every sample one by one, and compares every row (label and every
field) with the source. A trial is

- ``exact or PackError``: every row read is the source's, and an error is a ``PackError``
  naming the damaged shard file;
- ``silently wrong``: a row differs from the source, a sample is missing or repeated in an
  epoch that ended without an error;
- ``PackError not naming the shard``: refused, but the message does not say which file;
- ``other exception``: any other exception; ``crashed``: the child died or hung.

Run: ``python -m benchmarks.fuzz_shards [--trials 300] [--seed 0] [--seconds 900]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fuzz import damage, run_trials

OUTCOMES = (
    "exact or PackError",
    "silently wrong",
    "PackError not naming the shard",
    "other exception",
    "crashed",
)
COUNT, LOCAL_COUNT, BATCH, SHARD_SIZE = 96, 24, 10, "40KB"
PACKS = [(b, layout) for b in ("lmdb", "hdf5") for layout in ("columns", "records")]
SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}
_EDGE = 4096  # bytes at each end of a shard where half of the flips land


class Samples:
    """The source: fixed, ragged, text and scalar fields; ``offset`` names another dataset."""

    def __init__(self, count: int = COUNT, offset: int = 0) -> None:
        self.count, self.offset = count, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.count:
            raise IndexError(index)
        index += self.offset
        rng = np.random.default_rng(index)
        return {
            "img": rng.integers(0, 256, (16, 16, 3), np.uint8),
            "kp": rng.random((5, 2)).astype(np.float32),
            "boxes": rng.random((index % 4, 4)).astype(np.float32),
            "name": f"s{index:05d}" + "x" * (index % 5),
            "label": index % 7,
        }


def make_sharded(path: Path, backend: str, layout: str) -> Path:
    """The sharded pack of ``Samples()`` at ``path`` (a folder of shards + manifest)."""
    from fastloader import pack

    pack(Samples(), path, format=backend, layout=layout, shard_size=SHARD_SIZE, workers=0)
    return path


def make_local(path: Path) -> Path:
    """A single pack of other samples (``Samples(LOCAL_COUNT, offset=COUNT)``) for a Mix."""
    from fastloader import pack

    pack(Samples(LOCAL_COUNT, COUNT), path, workers=0)
    return path


_SOURCES = {"shards": Samples(), "local": Samples(LOCAL_COUNT, COUNT)}
_BY_NAME = {
    source: {dataset[i]["name"]: i for i in range(len(dataset))}
    for source, dataset in _SOURCES.items()
}


def _value(value: Any) -> Any:
    if hasattr(value, "numpy"):
        value = value.numpy()
    return value


def row_mismatch(source: str, row: dict) -> str | None:
    """None when ``row`` (a collated batch's row) is its source sample, else what differs."""
    index = _BY_NAME[source].get(row.get("name"))
    if index is None:
        return f"unknown name {row.get('name')!r}"
    want = _SOURCES[source][index]
    if sorted(row) != sorted(want):
        return f"{index}: fields {sorted(row)}"
    for name, expected in want.items():
        got = _value(row[name])
        if isinstance(expected, np.ndarray):
            same = (
                isinstance(got, np.ndarray)
                and got.dtype == expected.dtype
                and got.shape == expected.shape
                and np.array_equal(got, expected)
            )
        else:
            same = type(got) is not np.ndarray and got == expected
        if not same:
            return f"{index}: field {name!r}"
    return None


def batch_rows(batch: Any, mixed: bool) -> list[tuple[str, dict]]:
    """A batch's rows as ``(source, {field: value})`` (collated by ``ragged_as_lists``)."""
    sources = list(batch.source) if mixed else None
    if mixed:
        batch = batch.sample
    length = len(batch["name"])
    rows = []
    for at in range(length):
        row = {name: batch[name][at] for name in batch}
        row["label"] = int(row["label"])
        rows.append((sources[at] if mixed else "shards", row))
    return rows


def loader_for(folder: Path, local: Path | None, workers: int, seed: int, order: str) -> Any:
    """A loader over the sharded pack (with ``local`` in a ``Mix`` when given)."""
    from fastloader import DataLoader, Mix, ShardedDataset, ShardOrderSampler, open_pack
    from fastloader.datasets.collate import ragged_as_lists
    from fastloader.loader.mixing import MixCollate

    dataset: Any = ShardedDataset(folder)
    if local is not None:  # a user's collate_fn meets a Mix's samples: MixCollate unpacks them
        dataset = Mix({"shards": dataset, "local": open_pack(local)}, seed=seed)
        return DataLoader(
            dataset, batch_size=BATCH, num_workers=workers, collate_fn=MixCollate(ragged_as_lists)
        )
    options: dict[str, Any] = {"shuffle": True}
    if order == "shard_order":
        options = {"sampler": ShardOrderSampler(dataset, BATCH, 1, 0, seed=seed)}
    return DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=workers,
        seed=seed,
        collate_fn=ragged_as_lists,
        **options,
    )


def read_epoch(folder: Path, local: Path | None, workers: int, seed: int, order: str) -> dict:
    """One epoch through the loader: every row checked; ``{"wrong": [...], "error": ...}``."""
    from fastloader import PackError

    wrong: list[str] = []
    seen: dict[str, list[str]] = {"shards": [], "local": []}
    error = None
    try:
        loader = loader_for(folder, local, workers, seed, order)
        with loader:
            for batch in loader:
                for source, row in batch_rows(batch, local is not None):
                    seen[source].append(row.get("name"))
                    problem = row_mismatch(source, row)
                    if problem is not None:
                        wrong.append(f"{source} {problem}")
    except PackError as caught:
        error = f"PackError: {caught}"
    except Exception as caught:  # noqa: BLE001 - what we are looking for
        error = f"other: {type(caught).__name__}: {caught}"
    if error is None and local is None and sorted(seen["shards"]) != sorted(_BY_NAME["shards"]):
        wrong.append("the epoch's samples are not each sample once")
    return {"wrong": wrong[:5], "error": error and error[:400]}


def read_samples(folder: Path) -> dict:
    """Every sample one by one (``dataset[i]``): wrong rows, and the errors met."""
    from fastloader import PackError, ShardedDataset

    wrong, errors = [], []
    try:
        dataset = ShardedDataset(folder)
        for index in range(len(dataset)):
            try:
                sample = dataset[index]
            except PackError as caught:
                errors.append(f"PackError: {caught}"[:400])
                continue
            problem = row_mismatch("shards", dict(sample))
            if problem is not None or sample["name"] != _SOURCES["shards"][index]["name"]:
                wrong.append(f"sample {index}: {problem or 'another sample'}")
    except PackError as caught:
        errors.append(f"PackError: {caught}"[:400])
    except Exception as caught:  # noqa: BLE001
        errors.append(f"other: {type(caught).__name__}: {caught}"[:400])
    return {"wrong": wrong[:5], "errors": sorted(set(errors))[:3]}


def trial(spec: dict) -> dict:
    """Read one damaged folder as ``spec`` says (in the child)."""
    folder, local = Path(spec["folder"]), spec.get("local")
    epoch = read_epoch(folder, Path(local) if local else None, 0, spec["seed"], spec["order"])
    samples = read_samples(folder)
    return {"epoch": epoch, "samples": samples, "shard": spec["shard"]}


def _errors(result: dict) -> list[str]:
    return [e for e in [result["epoch"]["error"], *result["samples"]["errors"]] if e]


def classify(result: dict | None) -> str:
    """The outcome of one trial (the module docstring)."""
    if result is None:
        return "crashed"
    if result["epoch"]["wrong"] or result["samples"]["wrong"]:
        return "silently wrong"
    errors = _errors(result)
    if any(not e.startswith("PackError") for e in errors):
        return "other exception"
    if any(result["shard"] not in e for e in errors):
        return "PackError not naming the shard"
    return "exact or PackError"


def damaged_folder(
    clean: Path, into: Path, rng: np.random.Generator, kind: str
) -> tuple[Path, str]:
    """A copy of ``clean`` (its shards hard-linked) with one shard damaged: (folder, shard)."""
    from fastloader.shards.manifest import MANIFEST_NAME, file_checksum

    manifest = json.loads((clean / MANIFEST_NAME).read_text())
    shard = manifest["shards"][int(rng.integers(len(manifest["shards"])))]
    into.mkdir()
    for entry in manifest["shards"]:
        if entry is not shard:
            os.link(clean / entry["name"], into / entry["name"])
    data = (clean / shard["name"]).read_bytes()
    if kind == "flip" and rng.random() < 0.5:  # at the ends: headers, tables, metadata
        edge = min(_EDGE, len(data) // 2)
        ends = np.concatenate([np.arange(edge), np.arange(len(data) - edge, len(data))])
        damaged = bytearray(data)
        for position in rng.choice(ends, size=3, replace=False):
            damaged[int(position)] ^= int(rng.integers(1, 256))
        data = bytes(damaged)
    else:
        data = damage(data, rng, kind)
    (into / shard["name"]).write_bytes(data)
    if kind == "truncate":  # the manifest agrees: what is read is the shard's own checks
        shard["bytes"] = len(data)
        shard["xxh3_64"] = file_checksum(into / shard["name"])
    (into / MANIFEST_NAME).write_text(json.dumps(manifest))
    return into, shard["name"]


def fuzz(workdir: Path, trials: int, seed: int, seconds: float, chunk: int = 10) -> dict:
    """``trials`` damaged folders over the 4 packs (backend x layout), flips and truncations
    alternating, within about ``seconds``: ``{"counts", "cases", "trials", "refused"}`` (the
    trials that ended in a PackError naming the shard, of the first outcome)."""
    rng = np.random.default_rng(seed)
    cleans = {}
    for backend, layout in PACKS:
        cleans[backend, layout] = make_sharded(workdir / f"{backend}-{layout}", backend, layout)
    local = make_local(workdir / "local.lmdb")
    counts, cases, done, refused = dict.fromkeys(OUTCOMES, 0), [], 0, 0
    started = time.monotonic()
    while done < trials and time.monotonic() - started < seconds:
        specs, paths = [], []
        for number in range(done, min(done + chunk, trials)):
            backend, layout = PACKS[number % len(PACKS)]
            kind = "flip" if number % 3 else "truncate"
            folder, shard = damaged_folder(
                cleans[backend, layout], workdir / f"t{number}", rng, kind
            )
            spec = {
                "folder": str(folder),
                "shard": shard,
                "seed": number,
                "order": "shard_order" if number % 2 else "shuffle",
                "local": str(local) if number % 4 == 1 else None,
                "what": f"{backend}/{layout}/{kind}",
            }
            specs.append(spec)
            paths.append(json.dumps(spec))
        results = run_trials(
            paths, timeout=60 * len(paths), module_args=("benchmarks.fuzz_shards", "--child")
        )
        for spec, result in zip(specs, results, strict=True):
            outcome = classify(result)
            counts[outcome] += 1
            refused += outcome == OUTCOMES[0] and bool(_errors(result))
            if outcome != OUTCOMES[0]:
                cases.append({"what": spec["what"], "outcome": outcome, "result": result})
            shutil.rmtree(spec["folder"])
        done += len(specs)
    return {"counts": counts, "cases": cases, "trials": done, "refused": refused}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_shards")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.child:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(trial(json.loads(line))), flush=True)
        return
    with tempfile.TemporaryDirectory() as workdir:
        started = time.perf_counter()
        report = fuzz(Path(workdir), args.trials, args.seed, args.seconds)
    print("| sharded pack | trials | " + " | ".join(OUTCOMES) + " |")
    print("|---|---|" + "---|" * len(OUTCOMES))
    cells = " | ".join(str(report["counts"][name]) for name in OUTCOMES)
    print(
        f"| LMDB+HDF5 x columns+records, flips+truncations (seed {args.seed}) "
        f"| {report['trials']} | {cells} |  ({time.perf_counter() - started:.0f} s, "
        f"load {os.getloadavg()[0]:.1f})"
    )
    print(f"of which refused by a PackError naming the shard: {report['refused']}")
    for case in report["cases"][:20]:
        print(json.dumps(case)[:1500])


if __name__ == "__main__":
    main()
