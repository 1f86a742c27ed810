"""Users' own LMDB environments (LMDBDataset over a folder or file fastloader did not write).

NOTE [ Users' LMDB trees checked whole ] (formats/lmdb_tree.py): damaged trees are refused
before anything walks them; every hostile read runs in a subprocess (py-lmdb aborts on some).
"""

from __future__ import annotations

import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.fuzz_users import lmdb_tree_pages  # noqa: E402
from fastloader import DataLoader, LMDBDataset, PackError  # noqa: E402
from fastloader.formats.lmdb_foreign import LMDBFile  # noqa: E402

PSIZE = 4096
ROOT = Path(__file__).resolve().parents[1]


def make_env(path: Path, count: int = 300, seed: int = 0, sub: bool = False) -> dict:
    """An environment of ``count`` keys, small and overflow values, with deletes and updates."""
    rng = random.Random(seed)
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=2)
    values = {}
    with env.begin(write=True) as txn:
        for index in range(count):
            key = b"k%05d" % index
            values[key] = rng.randbytes(rng.choice([3, 40, 300, 5000]))
            txn.put(key, values[key])
    with env.begin(write=True) as txn:
        for key in sorted(values)[::7]:
            txn.delete(key)
            del values[key]
    if sub:
        with env.begin(write=True, db=env.open_db(b"named")) as txn:
            txn.put(b"inner", b"not a sample")
    env.close()
    return values


def pages(data: bytes) -> dict[int, list[int]]:
    """The main tree's pages of the newest meta: 1 branch, 2 leaf, 4 overflow (the first page
    of each value); the walker the structural fuzz uses (benchmarks/fuzz_users.py)."""
    return lmdb_tree_pages(data)


def read_in_child(path: Path) -> tuple[int, str]:
    """Read every sample of ``path`` in a fresh process: (its exit status, what it printed)."""
    code = (
        "import sys\n"
        "from fastloader import PackError\n"
        "from fastloader.formats.lmdb_foreign import LMDBFile\n"
        "try:\n"
        "    f = LMDBFile(sys.argv[1])\n"
        "    print('ok', len(f), sum(len(v) for v in f.read_many(range(len(f)))))\n"
        "except PackError as error:\n"
        "    print('PackError', error)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def env(tmp_path):
    path = tmp_path / "env"
    return path, make_env(path)


def test_values_come_back_in_key_order_equal_to_lmdb(env):
    path, values = env
    dataset = LMDBFile(path)
    assert [dataset.key(i) for i in range(len(dataset))] == sorted(values)
    assert dataset.read_many(range(len(dataset))) == [values[k] for k in sorted(values)]


def test_random_environments_with_deletes_and_updates_read_equal_to_lmdb(tmp_path):
    for seed in range(3):
        path = tmp_path / f"env{seed}"
        env = lmdb.open(str(path), map_size=1 << 28)
        rng, values = random.Random(seed), {}
        for _ in range(5):
            with env.begin(write=True) as txn:
                for _ in range(rng.randint(50, 400)):
                    key = rng.randbytes(rng.randint(1, 100))
                    values[key] = rng.randbytes(rng.choice([0, 10, 2100, 9000]))
                    txn.put(key, values[key])
                for key in rng.sample(sorted(values), len(values) // 3):
                    txn.delete(key)
                    del values[key]
        env.close()
        dataset = LMDBFile(path)
        assert dataset.read_many(range(len(dataset))) == [values[k] for k in sorted(values)]


def test_named_sub_databases_are_not_samples(tmp_path):
    path = tmp_path / "env"
    values = make_env(path, sub=True)
    dataset = LMDBFile(path)
    assert b"named" not in [dataset.key(i) for i in range(len(dataset))]
    assert len(dataset) == len(values)
    with pytest.raises(KeyError, match="sub-databases, not samples"):
        LMDBFile(path, keys=[b"named"])


def test_keys_must_be_bytes_or_str(env):
    path, values = env
    with pytest.raises(TypeError, match="keys must be bytes or str, got int 1"):
        LMDBDataset(path, keys=[1, 3])
    with pytest.raises(KeyError, match=r"no value under the keys \[b''\]"):
        LMDBDataset(path, keys=[b""])
    key = sorted(values)[4]
    assert LMDBDataset(path, keys=[key.decode()])[0] == values[key]


def test_a_main_database_of_other_flags_is_refused(tmp_path):
    path = tmp_path / "dup"
    make_env(path, count=10)
    data = bytearray((path / "data.mdb").read_bytes())
    for meta in (0, PSIZE):  # the main database's md_flags in both meta pages: MDB_DUPSORT
        struct.pack_into("<H", data, meta + 16 + 24 + 48 + 4, 0x04)
    (path / "data.mdb").write_bytes(bytes(data))
    status, out = read_in_child(path)
    assert status == 0 and "PackError" in out and "flags 0x4" in out, out


def _mutate(path: Path, change) -> Path:
    data = bytearray((path / "data.mdb").read_bytes())
    change(data, pages(bytes(data)))
    (path / "data.mdb").write_bytes(bytes(data))
    return path


def _child_of(data: bytearray, branch: int, node: int, target: int) -> None:
    (offset,) = struct.unpack_from("<H", data, branch * PSIZE + 16 + 2 * node)
    at = branch * PSIZE + offset
    struct.pack_into("<HHH", data, at, target & 0xFFFF, target >> 16 & 0xFFFF, target >> 32)


@pytest.mark.parametrize(
    "target, match",
    [
        (lambda found, branch: 0, "outside the .* pages in use, or a meta page"),
        (lambda found, branch: found[4][0], "a tree pointer to a page of flags 0x4"),
        (lambda found, branch: branch, "reached twice"),
        (lambda found, branch: 10**9, "outside the .* pages in use"),
    ],
    ids=["meta page", "overflow page", "itself", "past the end"],
)
def test_a_branch_pointer_aimed_anywhere_but_a_child_is_refused(env, target, match):
    path, _ = env

    def aim(data, found):
        branch = found[1][0]
        _child_of(data, branch, 1, target(found, branch))

    status, out = read_in_child(_mutate(path, aim))
    assert status == 0, f"the reader crashed ({status}): {out}"
    assert "PackError" in out and "damaged LMDB environment" in out, out
    assert re.search(match, out), out


def _overflow_nodes(data: bytes, leaf: int) -> list[int]:
    lower = struct.unpack_from("<H", data, leaf * PSIZE + 12)[0]
    found = []
    for node in range((lower - 16) // 2):
        (offset,) = struct.unpack_from("<H", data, leaf * PSIZE + 16 + 2 * node)
        if struct.unpack_from("<H", data, leaf * PSIZE + offset + 4)[0] & 1:
            found.append(leaf * PSIZE + offset)
    return found


@pytest.mark.parametrize("target", [0, 1, 10**6])
def test_an_overflow_pointer_aimed_at_a_meta_page_or_outside_is_refused(env, target):
    path, _ = env

    def aim(data, found):
        node = next(at for leaf in found[2] for at in _overflow_nodes(bytes(data), leaf))
        ksize = struct.unpack_from("<H", data, node + 6)[0]
        struct.pack_into("<Q", data, node + 8 + ksize, target)

    status, out = read_in_child(_mutate(path, aim))
    assert status == 0 and "PackError" in out and "overflow value on page" in out, out


@pytest.mark.parametrize("delta", [-2, -6, 2])
def test_a_flipped_mp_lower_is_refused_not_a_dropped_sample(env, delta):
    path, _ = env

    def flip(data, found):
        at = found[2][1] * PSIZE + 12
        struct.pack_into("<H", data, at, struct.unpack_from("<H", data, at)[0] + delta)

    status, out = read_in_child(_mutate(path, flip))
    assert status == 0 and "PackError" in out, out


def test_a_page_whose_keys_are_out_of_order_is_refused(env):
    path, _ = env

    def swap(data, found):
        leaf = found[2][0] * PSIZE
        first, second = struct.unpack_from("<HH", data, leaf + 16)
        struct.pack_into("<HH", data, leaf + 16, second, first)

    status, out = read_in_child(_mutate(path, swap))
    assert status == 0 and "PackError" in out and "out of order" in out, out


def test_an_environment_changed_while_read_is_an_error_per_batch(env):
    path, values = env
    dataset = LMDBDataset(path, decode=len)
    assert dataset[0] == len(values[sorted(values)[0]])
    environment = lmdb.open(str(path), map_size=1 << 28)
    with environment.begin(write=True) as txn:
        txn.put(b"new", b"value")
    environment.close()
    with pytest.raises(PackError, match="changed since this dataset opened it"):
        dataset[1]


def test_a_truncated_environment_read_through_workers_is_a_clear_error(tmp_path):
    code = (
        "import sys, time\n"
        "from fastloader import DataLoader, LMDBDataset, PackError\n"
        "ds = LMDBDataset(sys.argv[1], decode=len)\n"
        "loader = DataLoader(ds, batch_size=4, num_workers=int(sys.argv[2]), "
        "persistent_workers=False)\n"
        "try:\n"
        "    for i, batch in enumerate(loader):\n"
        "        if i == 1:\n"
        "            time.sleep(1.0)\n"
        "            data = sys.argv[1] + '/data.mdb'\n"
        "            open(data, 'r+b').truncate(8192)\n"
        "    print('no error')\n"
        "except PackError as error:\n"
        "    print('PackError', error)\n"
    )
    for workers in (0, 2):
        path = tmp_path / f"env{workers}"
        make_env(path)
        done = subprocess.run(
            [sys.executable, "-c", code, str(path), str(workers)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "PackError" in done.stdout and "changed since" in done.stdout, done.stdout


def test_the_values_decode_through_a_loader(env):
    path, values = env
    keys = sorted(values)[:8]
    dataset = LMDBDataset(path, keys=keys, decode=_length)
    loader = DataLoader(dataset, batch_size=4, num_workers=2)
    assert [n for batch in loader for n in batch["n"].tolist()] == [len(values[k]) for k in keys]


def _length(value: bytes) -> dict:
    return {"n": len(value)}
