"""Damaged users' files: structural mutations of HDF5 files and LMDB environments fastloader did
not write, each read in a subprocess that may crash.

Packs carry checksums (benchmarks/fuzz.py); a user's file does not, so a flipped byte in its
data is a different value that h5py or py-lmdb returns too. What must hold is NOTE [ Foreign
HDF5 files ] and NOTE [ Users' LMDB trees checked whole ]: every trial ends in samples equal
to the original, or equal to what h5py / py-lmdb return for the damaged file, or a PackError.
Each trial is one of

- ``correct or PackError``: as above;
- ``silently wrong``: samples (or their number, or the fields) differ from both the original
  and the library's reading of the damaged file, without an error;
- ``other exception``: an exception other than PackError escaped;
- ``crashed``: the reading process died (SIGBUS, SIGSEGV, SIGABRT) or hung.

The library's reading (the reference) runs in a separate child, since py-lmdb aborts on some
damaged trees; a reference that crashes or raises counts as "no reading": then only the
original's samples are correct.

Mutations are structural (the bytes readers trust, not the payload): HDF5 byte flips and
8-byte words (addresses, sizes) written outside the datasets' data, chunk index entries (a
chunk's stored size, filter mask or address set near or far from its value), a byte of a
variable-length string made one that is not UTF-8 there (h5py's ``asstr()`` refuses it: the
reference reads such a sample as no reading), random flips anywhere, and truncations; LMDB
flips and u16/u64 fields (page headers, node offsets, child and overflow pointers, set to 0, 1,
the page itself, another tree page, past the end) in the pages of the main tree and the meta
pages, random flips anywhere, and truncations.

Run: ``python -m benchmarks.fuzz_users [--trials 1000] [--seed 0] [--kinds hdf5,lmdb]``
(tests/test_users_fuzz.py runs a bounded version).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from benchmarks.fuzz import run_trials
from fastloader.formats.hdf5_text import TEXT_CODEC

OUTCOMES = ("correct or PackError", "silently wrong", "other exception", "crashed")
NOTES = ("of which refused", "the library died")
PSIZE = 4096
_BATCH = 5  # samples per read_many, as a loader's batches read them
HDF5_TEXTS = [f"t{i}é" for i in range(20)]  # the original's variable-length strings


# --- the originals ----------------------------------------------------------------------------


def make_hdf5(path: Path, count: int = 20) -> Path:
    """Contiguous (mapped) and chunked fields (gzip and unfiltered), strings fixed and variable,
    big-endian ints."""
    import h5py

    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as file:
        file["image"] = rng.integers(0, 256, (count, 6, 5, 3), np.uint8)
        file["part"] = rng.random((count, 7, 2), np.float32)
        file["id"] = np.arange(count, dtype=">i8") * 7
        file["name"] = np.array([f"n{index}".encode() for index in range(count)], "S6")
        file.create_dataset("text", data=HDF5_TEXTS[:count], dtype=h5py.string_dtype())
        file.create_dataset(
            "mask", data=rng.random((count, 9)) > 0.5, chunks=(4, 9), compression="gzip"
        )
        file.create_dataset(
            "depth", data=rng.integers(-99, 99, (count, 4), np.int16), chunks=(3, 4)
        )
    return path


def make_lmdb(path: Path, count: int = 160) -> Path:
    """Small, medium and overflow values, with deletes, updates and a named sub-database."""
    import lmdb

    rng = random.Random(5)
    env = lmdb.open(str(path), map_size=1 << 26, max_dbs=2)
    with env.begin(write=True) as txn:
        for index in range(count):
            txn.put(b"key%04d" % index, rng.randbytes(rng.choice([2, 60, 700, 5000])))
    with env.begin(write=True) as txn:
        for index in range(0, count, 9):
            txn.delete(b"key%04d" % index)
        for index in range(1, count, 11):
            txn.put(b"key%04d" % index, rng.randbytes(rng.choice([30, 3000])))
    with env.begin(write=True, db=env.open_db(b"named")) as txn:
        txn.put(b"inner", b"x" * 40)
    env.close()
    return path


# --- readings (in children) -------------------------------------------------------------------


def _digest(value) -> object:
    """A value as our reader or the library gives it, in one comparable form."""
    if isinstance(value, np.ndarray):
        native = (
            value.astype(value.dtype.newbyteorder("=")) if value.dtype.fields is None else value
        )
        return [native.dtype.str, list(native.shape), xxhash.xxh3_64_hexdigest(native.tobytes())]
    if isinstance(value, np.generic):
        return _digest(value.item()) if not isinstance(value, np.void) else value.tobytes().hex()
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, (list, tuple)):
        return [_digest(item) for item in value]
    if isinstance(value, float):
        return repr(value)
    return value


def _sample_digest(sample: dict) -> list[str]:
    """One digest per field (HDF5 samples are compared field by field: NOTE in classify)."""
    return [
        xxhash.xxh3_64_hexdigest(json.dumps(_digest(value), ensure_ascii=True).encode())
        for value in sample.values()
    ]


def ours(kind: str, path: str) -> dict:
    """Every sample as fastloader reads it (default fields / every key), in batches."""
    from fastloader import PackError
    from fastloader.formats.hdf5_foreign import HDF5File
    from fastloader.formats.lmdb_foreign import LMDBFile

    try:
        reader = HDF5File(path) if kind == "hdf5" else LMDBFile(path)
    except (PackError, FileNotFoundError):
        return {"open": "PackError"}
    except Exception as error:  # noqa: BLE001 - what we are looking for
        return {"open": f"other: {type(error).__name__}: {error}"[:300]}
    names = list(reader.field_names) if kind == "hdf5" else []
    samples: list = []
    for start in range(0, len(reader), _BATCH):
        batch = list(range(start, min(start + _BATCH, len(reader))))
        try:
            read = reader.read_many(batch)
            if kind == "hdf5":
                samples += [_sample_digest(sample) for sample in read]
            else:
                samples += [
                    [reader.key(i).hex(), xxhash.xxh3_64_hexdigest(v)]
                    for i, v in zip(batch, read, strict=True)
                ]
        except PackError:
            samples += ["PackError"] * len(batch)
        except Exception as error:  # noqa: BLE001
            samples += [f"other: {type(error).__name__}: {error}"[:300]] * len(batch)
    return {"open": "ok", "names": names, "samples": samples}


def reference(kind: str, path: str) -> dict:
    """What h5py / py-lmdb give for the file; {"open": "error"} where they raise."""
    try:
        return _h5py_reading(path) if kind == "hdf5" else _lmdb_reading(path)
    except Exception:  # noqa: BLE001 - the library refuses the file: no reading
        return {"open": "error"}


def _h5py_reading(path: str) -> dict:
    """Each top-level dataset read whole by h5py; a field h5py cannot read is "error" in every
    sample (the other fields still count)."""
    import h5py

    with h5py.File(path, "r") as file:
        names = [name for name in file.keys() if isinstance(file[name], h5py.Dataset)]
        columns, codecs = {}, {}
        for name in names:
            try:
                columns[name] = file[name][()]
                codecs[name] = getattr(h5py.check_string_dtype(file[name].dtype), "encoding", None)
            except Exception:  # noqa: BLE001 - this field has no reading
                columns[name] = None
    lengths = {len(column) for column in columns.values() if column is not None}
    if len(lengths) != 1:
        return {"open": "error"}
    samples = []
    for row in range(lengths.pop()):
        digests = []
        for name, column in columns.items():
            if column is None:
                digests.append("error")
                continue
            value = column[row]
            if isinstance(value, np.ndarray) and value.dtype.kind in "OS":
                value = value.tolist()
            if codecs.get(name):  # a string: as asstr() decodes it (ASCII as UTF-8), or none
                try:
                    value = value.decode(TEXT_CODEC)
                except UnicodeDecodeError:
                    digests.append("error")
                    continue
            digests.append(_sample_digest({"v": value})[0])
        samples.append(digests)
    return {"open": "ok", "names": names, "samples": samples}


def _lmdb_reading(path: str) -> dict:
    import lmdb

    env = lmdb.open(path, subdir=os.path.isdir(path), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        items = [(key, value) for key, value in txn.cursor()]
    samples = []
    for key, value in items:
        if len(value) == 48:  # an MDB_db record: a sub-database if LMDB opens it as one
            try:
                env.open_db(key, create=False)
                continue
            except lmdb.Error:
                pass
        samples.append([key.hex(), xxhash.xxh3_64_hexdigest(value)])
    env.close()
    return {"open": "ok", "names": [], "samples": samples}


def classify(original: dict, got: dict | None, library: dict | None) -> str:
    """One trial's outcome (module docstring); None: that child died on the file."""
    if got is None:
        return "crashed"
    if got["open"] != "ok":
        return "correct or PackError" if got["open"] == "PackError" else "other exception"
    if any(isinstance(s, str) and s.startswith("other") for s in got["samples"]):
        return "other exception"
    # A sample read is right if it is the original's, or the library's reading of the damaged
    # file; an HDF5 sample field by field (h5py reads, or fails, per dataset: a field equal to
    # the original's and another equal to h5py's is right), an LMDB sample (key, value) whole.
    readings = [want for want in (original, library) if want and want.get("open") == "ok"]
    readings = [want for want in readings if want["names"] == got["names"]]
    readings = [want for want in readings if len(want["samples"]) == len(got["samples"])]
    if not readings:
        return "silently wrong"
    by_field = bool(got["names"])
    for at, have in enumerate(got["samples"]):
        if have == "PackError" or any(want["samples"][at] == have for want in readings):
            continue
        fields = zip(*(want["samples"][at] for want in readings), strict=True)
        if not by_field or not all(
            value in choices for value, choices in zip(have, fields, strict=True)
        ):
            return "silently wrong"
    return "correct or PackError"


# --- mutations ----------------------------------------------------------------------------------


def hdf5_data_ranges(path: Path) -> list[tuple[int, int]]:
    """The byte ranges of the original's raw data (contiguous datasets and chunks)."""
    import h5py

    ranges = []
    with h5py.File(path, "r") as file:
        for name in file:
            dataset = file[name].id
            if dataset.get_offset() is not None:
                ranges.append((dataset.get_offset(), dataset.get_storage_size()))
            elif dataset.get_create_plist().get_layout() == h5py.h5d.CHUNKED:
                for index in range(dataset.get_num_chunks()):
                    info = dataset.get_chunk_info(index)
                    ranges.append((info.byte_offset, info.size))
    return ranges


def hdf5_chunk_key(info) -> bytes:
    """The version-1 B-tree key (h5py's default format) of the chunk ``info`` (h5py's
    ``get_chunk_info``), with the child address after it: a u32 stored size, a u32 filter mask,
    the chunk's offsets and a 0 as u64s, then the chunk's address as a u64."""
    rank = len(info.chunk_offset)
    return struct.pack(
        f"<II{rank + 1}QQ", info.size, info.filter_mask, *info.chunk_offset, 0, info.byte_offset
    )


def hdf5_chunk_entries(data: bytes, path: Path) -> list[tuple[int, int]]:
    """Where each chunk's B-tree key (``hdf5_chunk_key``) lies in ``data``, the file at
    ``path``, with the chunk's rank."""
    import h5py

    entries = []
    with h5py.File(path, "r") as file:
        for name in file:
            dataset = file[name].id
            if dataset.get_create_plist().get_layout() != h5py.h5d.CHUNKED:
                continue
            for index in range(dataset.get_num_chunks()):
                info = dataset.get_chunk_info(index)
                key = hdf5_chunk_key(info)
                assert data.count(key) == 1, f"{name}: chunk {index}'s key not found once"
                entries.append((data.index(key), len(info.chunk_offset)))
    return entries


def hdf5_string_bytes(data: bytes, texts: list[str]) -> list[tuple[int, int]]:
    """Where the bytes of each of ``texts`` (a variable-length dataset's strings, each stored
    once in a global heap object) lie in ``data``: (start, length)."""
    found = []
    for text in texts:
        encoded = text.encode()
        at = data.find(struct.pack("<Q", len(encoded)) + encoded)  # after its object's size
        if at >= 0:
            found.append((at + 8, len(encoded)))
    return found


def _damage_chunk_entry(out: bytearray, rng: random.Random, entries: list) -> None:
    """A chunk's stored size, filter mask or address set to a nearby or random value."""
    at, rank = rng.choice(entries)
    field = rng.choice(["size", "size", "mask", "address"])
    if field == "address":
        where, width = at + 8 + 8 * (rank + 1), 8
    else:
        where, width = at + (0 if field == "size" else 4), 4
    old = int.from_bytes(out[where : where + width], "little")
    value = rng.choice([0, 1, old - rng.randint(1, 16), old + rng.randint(1, 16), old // 2,
                        rng.randrange(1 << (8 * width))])  # fmt: skip
    out[where : where + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def mutate_hdf5(
    data: bytes, rng: random.Random, data_ranges: list, targets: dict | None = None
) -> tuple[bytes, str]:
    """One damaged copy of ``data``; ``targets`` (``chunk entries``, ``string bytes``: where
    they lie) adds damage aimed at chunk index entries and the bytes of strings."""
    in_data = np.zeros(len(data), bool)
    for start, size in data_ranges:
        in_data[start : start + size] = True
    structure = np.flatnonzero(~in_data)
    out = bytearray(data)
    aimed = ["chunk entry", "chunk entry", "string bytes"] if targets else []
    kind = rng.choice(["meta flip", "meta flip", "meta word", "meta word", "any flip", "truncate",
                       *aimed])  # fmt: skip
    if kind == "chunk entry":
        _damage_chunk_entry(out, rng, targets["chunk entries"])
        return bytes(out), kind
    if kind == "string bytes":  # a byte of a string that is not UTF-8 there
        start, length = rng.choice(targets["string bytes"])
        out[start + rng.randrange(length)] = rng.choice([0x80, 0xBF, 0xC3, 0xEB, 0xFF])
        return bytes(out), kind
    if kind == "truncate":
        return bytes(out[: rng.randrange(len(out))]), kind
    if kind == "meta word":
        at = int(structure[rng.randrange(len(structure) - 8)])
        value = rng.choice(
            [
                0,
                (1 << 64) - 1,
                rng.randrange(len(data)),
                len(data) + rng.randrange(1 << 20),
                rng.randrange(1 << 64),
            ]
        )
        width = rng.choice([2, 4, 8])
        out[at : at + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        return bytes(out), kind
    positions = structure if kind == "meta flip" else np.arange(len(data))
    for _ in range(rng.randint(1, 3)):
        out[int(positions[rng.randrange(len(positions))])] ^= rng.randrange(1, 256)
    return bytes(out), kind


def lmdb_tree_pages(data: bytes) -> dict[int, list[int]]:
    """The main tree's pages of the newest meta: 1 branch, 2 leaf, 4 overflow (first pages)."""
    meta = max((0, PSIZE), key=lambda at: struct.unpack_from("<Q", data, at + 144)[0])
    todo = [struct.unpack_from("<Q", data, meta + 16 + 24 + 48 + 40)[0]]
    found: dict[int, list[int]] = {1: [], 2: [], 4: []}
    while todo:
        base = (pgno := todo.pop()) * PSIZE
        _, _, flags, lower = struct.unpack_from("<QHHH", data, base)
        found[flags].append(pgno)
        for node in range((lower - 16) // 2):
            (offset,) = struct.unpack_from("<H", data, base + 16 + 2 * node)
            lo, hi, node_flags, ksize = struct.unpack_from("<HHHH", data, base + offset)
            if flags == 1:
                todo.append(lo | hi << 16 | node_flags << 32)
            elif node_flags & 1:
                found[4].append(struct.unpack_from("<Q", data, base + offset + 8 + ksize)[0])
    return found


def _in_page(rng: random.Random) -> int:
    """A byte of a page that readers trust: near its start (header, node offsets), or near
    its end, where LMDB packs the nodes (headers, keys, small values)."""
    distance = min(int(rng.expovariate(1 / 128)), PSIZE - 1)
    return distance if rng.random() < 0.5 else PSIZE - 1 - distance


def mutate_lmdb(data: bytes, rng: random.Random, tree: dict) -> tuple[bytes, str]:
    out = bytearray(data)
    pages = tree[1] + tree[2]
    kind = rng.choice(
        [
            "page flip",
            "page flip",
            "header u16",
            "node u16",
            "pointer",
            "meta flip",
            "any flip",
            "truncate",
        ]
    )
    if kind == "truncate":
        return bytes(out[: rng.randrange(len(out))]), kind
    if kind in ("any flip", "meta flip", "page flip"):
        page = {"meta flip": rng.choice([0, 1]), "page flip": rng.choice(pages + tree[4])}.get(kind)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(out)) if page is None else page * PSIZE + _in_page(rng)
            out[at] ^= rng.randrange(1, 256)
        return bytes(out), kind
    page = rng.choice(pages)
    base = page * PSIZE
    lower = struct.unpack_from("<H", out, base + 12)[0]
    node = base + struct.unpack_from("<H", out, base + 16 + 2 * rng.randrange((lower - 16) // 2))[0]
    if kind == "header u16":
        at = base + rng.choice([10, 12, 14, 16])
    elif kind == "node u16":
        at = node + rng.choice([0, 2, 4, 6])
    if kind in ("header u16", "node u16"):
        old = struct.unpack_from("<H", out, at)[0]
        struct.pack_into(
            "<H", out, at, rng.choice([0, 1, old + 2, old - 2, rng.randrange(1 << 16)]) & 0xFFFF
        )
        return bytes(out), kind
    target = rng.choice(
        [
            0,
            1,
            page,
            rng.choice(tree[1] + tree[2] + tree[4] or [2]),
            len(data) // PSIZE + rng.randrange(4),
            rng.randrange(1 << 32),
        ]
    )
    if struct.unpack_from("<H", out, base + 10)[0] == 1:  # a branch: its child pointer
        struct.pack_into(
            "<HHH", out, node, target & 0xFFFF, target >> 16 & 0xFFFF, target >> 32 & 0xFFFF
        )
    else:  # a leaf: an overflow pointer if the node has one, else its data size
        flags, ksize = struct.unpack_from("<HH", out, node + 4)
        if flags & 1:
            struct.pack_into("<Q", out, node + 8 + ksize, target)
        else:
            struct.pack_into("<HH", out, node, target & 0xFFFF, target >> 16 & 0xFFFF)
    return bytes(out), kind


# --- running ----------------------------------------------------------------------------------


def run_children(paths: list[Path], kind: str, role: str, timeout: float = 120.0) -> list:
    """``role`` ("ours" or "reference") reading of each file in child processes; None for the
    file a child died (or hung) on."""
    return run_trials(paths, timeout, ("benchmarks.fuzz_users", "--child", f"{role}:{kind}"))


def fuzz(workdir: Path, kind: str, trials: int, seed: int) -> tuple[dict, dict]:
    """Outcome counts of ``trials`` mutated copies, and the counts by mutation (with NOTES:
    how many we refused in whole or part, how many the library crashed or hung on)."""
    rng = random.Random(seed)
    if kind == "hdf5":
        original = make_hdf5(workdir / "original.h5")
        data = original.read_bytes()
        ranges = hdf5_data_ranges(original)
        targets = {
            "chunk entries": hdf5_chunk_entries(data, original),
            "string bytes": hdf5_string_bytes(data, HDF5_TEXTS),
        }
        mutate, suffix = (lambda: mutate_hdf5(data, rng, ranges, targets)), ".h5"
    else:
        original = make_lmdb(workdir / "original-env") / "data.mdb"
        data = original.read_bytes()
        tree = lmdb_tree_pages(data)
        mutate, suffix = (lambda: mutate_lmdb(data, rng, tree)), ".mdb"
    expected = ours(kind, str(original))
    assert expected["open"] == "ok" and expected == reference(kind, str(original)), expected
    paths, kinds = [], []
    for trial in range(trials):
        damaged, what = mutate()
        path = workdir / f"{kind}-{trial}{suffix}"
        path.write_bytes(damaged)
        paths.append(path)
        kinds.append(what)
    got = run_children(paths, kind, "ours", timeout=60.0 + trials / 5)
    library = run_children(paths, kind, "reference", timeout=60.0 + trials / 5)
    counts = dict.fromkeys(OUTCOMES, 0)
    by_kind: dict = {}
    for path, what, have, ref in zip(paths, kinds, got, library, strict=True):
        outcome = classify(expected, have, ref)
        counts[outcome] += 1
        cells = by_kind.setdefault(what, dict.fromkeys((*OUTCOMES, *NOTES), 0))
        cells[outcome] += 1
        cells["of which refused"] += _refused(have)
        cells["the library died"] += ref is None
        if outcome != OUTCOMES[0]:
            print(f"  {outcome}: {path.name} ({what})", file=sys.stderr)
    return counts, by_kind


def _refused(got: dict | None) -> bool:
    """Whether our reading refused the file, or some of its samples, with a PackError."""
    if got is None:
        return False
    return got["open"] == "PackError" or "PackError" in got.get("samples", [])


def _child(spec: str) -> None:
    role, kind = spec.split(":")
    read = ours if role == "ours" else reference
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(read(kind, line.strip())), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_users")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="hdf5,lmdb")
    parser.add_argument("--keep", help="keep the mutated files in this folder")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return
    print("| users' files | mutation | trials | " + " | ".join((*OUTCOMES, *NOTES)) + " |")
    print("|---|---|---|" + "---|" * (len(OUTCOMES) + len(NOTES)))
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            workdir = Path(args.keep or scratch) / kind
            workdir.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            counts, by_kind = fuzz(workdir, kind, args.trials, args.seed)
            seconds = time.perf_counter() - started
            for what, cells in sorted(by_kind.items()):
                row = " | ".join(str(cells[name]) for name in (*OUTCOMES, *NOTES))
                print(f"| {kind.upper()} | {what} | {sum(cells[n] for n in OUTCOMES)} | {row} |")
            notes = [sum(cells[name] for cells in by_kind.values()) for name in NOTES]
            row = " | ".join(str(value) for value in [*counts.values(), *notes])
            print(
                f"| {kind.upper()} | all | {args.trials} | {row} |  ({seconds:.0f} s)", flush=True
            )


if __name__ == "__main__":
    main()
