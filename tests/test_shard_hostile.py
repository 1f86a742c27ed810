"""A sharded pack tampered with: shards that disagree with the manifest, a shard rewritten, cut
or replaced while a loader has it open, a symlink in the shard cache. Each is a PackError
naming the shard (and the field), never a batch of another shard's or field's values
(NOTE [ Shards that disagree with their manifest ], NOTE [ A shard changed on disk ])."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fastloader import DataLoader, PackError, ShardedDataset, pack
from fastloader.shards.cache import ShardCache
from fastloader.shards.stores import read_manifest
from tests._remote_like import RemoteLike

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


class Pair:
    """Two fields of one shape and dtype (``a`` = index + offset, ``b`` = its negative)."""

    def __init__(self, offset: int = 0, variant: str = "") -> None:
        self.offset, self.variant = offset, variant

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> dict:
        value = float(i + self.offset)
        a, b = np.full(300, value, np.float32), np.full(300, -value, np.float32)
        sample = {"a": a, "b": b, "label": i}
        if self.variant == "swapped":
            sample = {"b": b, "a": a, "label": i}
        elif self.variant == "float64":
            sample["a"] = a.astype(np.float64)
        elif self.variant == "extra":
            sample["c"] = np.zeros(2, np.int8)
        return sample


def _sharded(path, backend, source):
    pack(source, path, format=backend, shard_size="60KB", workers=0)
    assert len(read_manifest(RemoteLike(path)).shards) >= 3
    return path


def _graft(target, donor):
    """Shard 0 of ``donor`` in place of ``target``'s, the manifest made to agree."""
    manifest = json.loads((target / "manifest.json").read_text())
    given = json.loads((donor / "manifest.json").read_text())["shards"][0]
    shutil.copyfile(donor / given["name"], target / manifest["shards"][0]["name"])
    manifest["shards"][0].update(count=given["count"], bytes=given["bytes"])
    manifest["shards"][0]["xxh3_64"] = given["xxh3_64"]
    manifest["shards"][0]["metadata_xxh3_64"] = given["metadata_xxh3_64"]  # its fingerprint
    manifest["count"] = sum(shard["count"] for shard in manifest["shards"])
    (target / "manifest.json").write_text(json.dumps(manifest))
    return manifest["shards"][0]["name"]


@pytest.mark.parametrize(
    ("variant", "said"),
    [("swapped", "order"), ("float64", "'a'"), ("extra", "['c']")],
)
@pytest.mark.parametrize("backend", sorted(SUFFIX))
def test_a_shard_whose_fields_disagree_with_the_manifest_is_refused(
    tmp_path, backend, variant, said
):
    # swapped: 'a' and 'b' of one shape in another order; read by columns, each column taken
    # by its position, the batch gave b's values under 'a' with no error; an extra field was
    # dropped; another dtype was promoted by the collate
    target = _sharded(tmp_path / "pack", backend, Pair())
    name = _graft(target, _sharded(tmp_path / "other", backend, Pair(variant=variant)))
    dataset = ShardedDataset(target)
    loader = DataLoader(dataset, batch_size=len(dataset), num_workers=0)
    with pytest.raises(PackError, match=name) as batch_error:
        next(iter(loader))
    assert said in str(batch_error.value) and "manifest" in str(batch_error.value)
    with pytest.raises(PackError, match=name):
        ShardedDataset(target)[0]
    assert np.array_equal(dataset[len(dataset) - 1]["a"], Pair()[59]["a"])  # others still read


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a child (a mapped file cut shorter kills its reader with SIGBUS)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


@pytest.mark.parametrize("change", ["rewritten", "shorter", "replaced"])
@pytest.mark.parametrize("backend", sorted(SUFFIX))
def test_a_shard_changed_while_a_loader_reads_it_is_refused_naming_it(tmp_path, backend, change):
    target = _sharded(tmp_path / "pack", backend, Pair())
    other = _sharded(tmp_path / "other", backend, Pair(offset=1000))  # same sizes, other values
    shard = read_manifest(RemoteLike(target)).shards[0].name
    assert (target / shard).stat().st_size == (other / shard).stat().st_size
    result = _run(
        f"""
        import os, shutil, time
        import numpy as np
        from fastloader import DataLoader, PackError, ShardedDataset
        target, other, shard = {str(target)!r}, {str(other)!r}, {shard!r}
        dataset = ShardedDataset(target, open_shards=1000)
        loader = DataLoader(dataset, batch_size=7, num_workers=0)
        first = next(iter(loader))  # every block of shard 0 read and verified
        assert first["a"][:, 0].tolist() == list(range(7))
        path = os.path.join(target, shard)
        if {change!r} == "rewritten":
            with open(path, "r+b") as handle:
                handle.write(open(os.path.join(other, shard), "rb").read())
        elif {change!r} == "shorter":
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            shutil.copyfile(os.path.join(other, shard), path + ".new")
            os.replace(path + ".new", path)
        time.sleep(0.2)  # a shard's identity is checked again once 0.1 s old
        for read in (lambda: next(iter(loader)), lambda: dataset[3]):
            try:
                got = read()
                print("READ", np.asarray(got["a"]).ravel()[:1].tolist())
            except PackError as error:
                print("REFUSED", error)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("REFUSED") for line in lines), result.stdout
    assert all(shard in line and "changed on disk" in line for line in lines)


def test_a_symlink_in_the_shard_cache_is_refused(tmp_path):
    # the cache checks a shard's bytes when it downloads it; a file it finds there of the right
    # size is taken as that download, so a link to another pack's shard read as this one
    source = _sharded(tmp_path / "pack", "lmdb", Pair())
    other = _sharded(tmp_path / "other", "lmdb", Pair(offset=1000))
    store = RemoteLike(source)
    manifest = read_manifest(store)
    biggest = max(shard.bytes for shard in manifest.shards)
    cache = ShardCache(store, manifest, tmp_path / "cache", 100 * biggest, biggest)
    shard = manifest.shards[0]
    os.symlink(other / shard.name, cache.path(shard))
    dataset = ShardedDataset(source)
    dataset.cache = cache  # as a URL's dataset has it (RemoteLike: no local path)
    with pytest.raises(PackError, match="symbolic link"):
        dataset[0]
    with pytest.raises(PackError, match=shard.name):
        dataset.read_batch_columns([0, 1, 40])
    assert dataset[len(dataset) - 1]["a"][0] == 59  # a shard downloaded and checked reads


@pytest.mark.parametrize("more", [1, -2])
@pytest.mark.parametrize("backend", sorted(SUFFIX))
def test_a_shard_holding_another_count_than_the_manifest_says_is_refused(tmp_path, backend, more):
    # one more: the row past the shard's end was an IndexError or a ValueError of the copy,
    # naming nothing; fewer: the shard's last samples were never read, silently
    target = _sharded(tmp_path / "pack", backend, Pair())
    manifest = json.loads((target / "manifest.json").read_text())
    first = manifest["shards"][0]
    first["count"] += more
    manifest["count"] += more
    (target / "manifest.json").write_text(json.dumps(manifest))
    dataset = ShardedDataset(target)
    end = first["count"] - 1  # the last row of shard 0, as the manifest says
    with pytest.raises(PackError, match=f"{first['name']}.*{first['count'] - more} samples"):
        dataset.read_batch_columns([end, end - 1])
    with pytest.raises(PackError, match=first["name"]):
        ShardedDataset(target)[end]
