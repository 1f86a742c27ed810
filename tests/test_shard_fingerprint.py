"""Shard fingerprints (issue 37; NOTE [ Shard fingerprints ] in fastloader/shards/manifest.py):
a shard of a folder replaced, before it is opened, by another pack's shard of the same size,
count, schema and classes is refused when it is opened, naming it, where it used to be read as
it was (wrong samples, silently); manifests of the previous release, without fingerprints,
still read; a malformed fingerprint is refused naming the field; downloaded shards are checked
too; ``--verify`` and ``--info`` say it. Records spliced from another pack are found by
``verify`` (NOTE [ Metadata checksums ] in fastloader/formats/metadata.py)."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest

from fastloader import DataLoader, PackError, ShardedDataset, cli, pack, verify
from fastloader.shards.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from fastloader.shards.stores import open_store, read_manifest
from tests._fields import Indexed
from tests.conftest import S3_BUCKET

COUNT = 120


class Shifted(Indexed):
    """``Indexed``'s samples with ``offset`` added to both fields: another pack of the same
    sizes, count and schema."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__(COUNT, side=8)
        self.offset = offset

    def __getitem__(self, i: int) -> dict:
        return super().__getitem__(i + self.offset)


def _sharded(path, backend="lmdb", layout="columns", offset=0):
    pack(Shifted(offset), path, format=backend, layout=layout, shard_size="12KB", workers=0)
    assert len(_manifest(path)["shards"]) >= 3
    return path


def _manifest(folder) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


def _write_manifest(folder, manifest: dict) -> None:
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def _agreeing(entry: dict) -> dict:
    """What a shard was checked against at open before fingerprints (schema and classes are
    the manifest's, the same in both packs)."""
    return {key: entry[key] for key in ("name", "count", "bytes")}


@pytest.mark.parametrize("layout", ["columns", "records"])
@pytest.mark.parametrize("backend", ["hdf5", "lmdb"])
def test_another_packs_shard_swapped_in_before_it_is_opened_is_refused_naming_it(
    tmp_path, capsys, backend, layout
):
    target = _sharded(tmp_path / "a", backend, layout)
    other = _sharded(tmp_path / "b", backend, layout, offset=1000)
    mine, theirs = _manifest(target), _manifest(other)
    assert {k: mine[k] for k in ("schema", "classes")} == {
        k: theirs[k] for k in ("schema", "classes")
    }
    shard = mine["shards"][1]
    assert _agreeing(theirs["shards"][1]) == _agreeing(shard)  # the size check passes
    shutil.copyfile(other / shard["name"], target / shard["name"])
    dataset = ShardedDataset(target)
    first = mine["shards"][0]["count"]  # shard 1's first sample
    # before: sample `first` read as 1000 + first, with no error
    with pytest.raises(PackError, match=rf"{shard['name']}: .*metadata_xxh3_64") as error:
        dataset[first]
    assert "does not match the sharded pack's manifest" in str(error.value)
    loader = DataLoader(dataset, batch_size=len(dataset), num_workers=0)
    with pytest.raises(PackError, match=shard["name"]):
        next(iter(loader))  # a batch read by columns (or by records) opens it the same way
    assert int(dataset[first - 1]["y"]) == first - 1  # the pack's own shards still read
    assert cli.main(["--verify", str(target)]) == 1
    assert shard["name"] in capsys.readouterr().err


def test_a_manifest_without_fingerprints_reads_as_before(tmp_path, capsys):
    # a manifest of the previous release: no metadata_xxh3_64; that release ignores the field
    target = _sharded(tmp_path / "a")
    manifest = _manifest(target)
    assert all(len(entry["metadata_xxh3_64"]) == 16 for entry in manifest["shards"])
    for entry in manifest["shards"]:
        del entry["metadata_xxh3_64"]
    _write_manifest(target, manifest)
    dataset = ShardedDataset(target)
    assert all(shard.metadata_xxh3_64 is None for shard in dataset.manifest.shards)
    batch = next(iter(DataLoader(dataset, batch_size=COUNT, num_workers=0)))
    assert batch["y"].tolist() == list(range(COUNT))
    assert json.loads(dataset.manifest.to_json()) == manifest  # written back without the field
    assert cli.main(["--info", str(target)]) == 0
    assert "without fingerprints" in capsys.readouterr().out
    assert cli.main(["--verify", str(target)]) == 0


@pytest.mark.parametrize("value", ["zz", 7, None, "ABCDEF0123456789", "0" * 17, ""])
def test_a_malformed_fingerprint_is_refused_naming_the_field(tmp_path, value):
    target = _sharded(tmp_path / "a")
    manifest = _manifest(target)
    manifest["shards"][1]["metadata_xxh3_64"] = value
    _write_manifest(target, manifest)
    field = r"manifest field shards\[1\]\.metadata_xxh3_64: must be 16 lowercase hex digits"
    with pytest.raises(ManifestError, match=field):
        parse_manifest(json.dumps(manifest).encode(), str(target / MANIFEST_NAME))
    with pytest.raises(ManifestError, match=field):
        ShardedDataset(target)


def test_a_fingerprint_the_shard_does_not_have_is_refused_at_open_and_by_verify(tmp_path, capsys):
    target = _sharded(tmp_path / "a", "hdf5", "records")
    manifest = _manifest(target)
    entry = manifest["shards"][2]
    entry["metadata_xxh3_64"] = f"{int(entry['metadata_xxh3_64'], 16) ^ 1:016x}"
    _write_manifest(target, manifest)
    assert cli.main(["--info", str(target)]) == 0
    shards = len(manifest["shards"])
    assert f"metadata fingerprint of {shards} of {shards} shards" in capsys.readouterr().out
    dataset = ShardedDataset(target)
    at = manifest["shards"][0]["count"] + manifest["shards"][1]["count"]
    with pytest.raises(PackError, match=rf"{entry['name']}: .*{entry['metadata_xxh3_64']}"):
        dataset[at]
    assert int(dataset[at - 1]["y"]) == at - 1
    # its bytes are the manifest's (xxh3_64 matches): only the fingerprint tells
    assert cli.main(["--verify", str(target)]) == 1
    err = capsys.readouterr().err
    assert entry["name"] in err and "metadata_xxh3_64" in err


def test_verify_finds_another_packs_records_under_a_packs_metadata(tmp_path):
    # every record passes its own checksum (bound to its position only) and the metadata is
    # the pack's own: only the metadata's checksum of the records' headers tells
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for path, offset in zip(paths, (0, 1000), strict=True):
        pack(Shifted(offset), path, layout="records", workers=0)
    assert verify(paths[0]).ok
    with h5py.File(paths[1], "r") as donor, h5py.File(paths[0], "r+") as spliced:
        assert donor["records"].shape == spliced["records"].shape
        spliced["records"][:] = donor["records"][:]
    with pytest.raises(PackError, match=rf"{paths[0]}: its records are not the ones its metadata"):
        verify(paths[0])
    assert cli.main(["--verify", str(paths[0]), "-q"]) == 2


@pytest.mark.slow
def test_a_downloaded_shard_is_checked_against_its_fingerprint_too(s3, tmp_path):
    import boto3

    target, other = f"s3://{S3_BUCKET}/fingerprints", f"s3://{S3_BUCKET}/fingerprints-other"
    for url, offset in ((target, 0), (other, 1000)):
        pack(Shifted(offset), url, shard_size="12KB", workers=0)
    manifest = read_manifest(open_store(target))
    assert all(shard.metadata_xxh3_64 for shard in manifest.shards)
    dataset = ShardedDataset(target, cache_dir=tmp_path / "cache")
    assert [int(dataset[i]["y"]) for i in range(COUNT)] == list(range(COUNT))
    # another pack's shard on the server, the manifest's size and digest made to agree: it
    # downloads and passes the digest, and is refused when opened
    client = boto3.client("s3")
    name = manifest.shards[1].name
    swapped = client.get_object(Bucket=S3_BUCKET, Key=f"fingerprints-other/{name}")["Body"].read()
    client.put_object(Bucket=S3_BUCKET, Key=f"fingerprints/{name}", Body=swapped)
    raw = json.loads(
        client.get_object(Bucket=S3_BUCKET, Key="fingerprints/manifest.json")["Body"].read()
    )
    theirs = read_manifest(open_store(other)).shards[1]
    raw["shards"][1].update(bytes=theirs.bytes, xxh3_64=theirs.xxh3_64)
    client.put_object(Bucket=S3_BUCKET, Key="fingerprints/manifest.json", Body=json.dumps(raw))
    dataset = ShardedDataset(target, cache_dir=tmp_path / "fresh")
    with pytest.raises(PackError, match=rf"{name}: .*metadata_xxh3_64"):
        dataset[manifest.shards[0].count]
    assert int(dataset[0]["y"]) == 0
    assert np.array_equal(dataset[COUNT - 1]["x"], Shifted()[COUNT - 1]["x"])
