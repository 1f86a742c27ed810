"""Sharded packs: pack(..., shard_size=) writes ordinary packs plus a manifest written last; the
manifest is untrusted input; --info and --verify work on a sharded folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastloader import cli, pack
from fastloader.datasets.packs import open_pack
from fastloader.shards.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from fastloader.shards.sizes import parse_size
from fastloader.shards.stores import LocalStore, open_store, read_manifest
from tests._fields import Indexed


class Fields(Indexed):
    """300 samples (or ``n``) of 8 x 8 ``x`` and ``y``, both naming their index."""

    def __init__(self, n: int = 300) -> None:
        super().__init__(n, side=8)


@pytest.fixture
def sharded(tmp_path):
    summary = pack(Fields(), tmp_path / "out", shard_size="40KB", workers=0)
    return tmp_path / "out", summary


def test_every_shard_is_an_ordinary_pack_and_together_they_hold_every_sample(sharded):
    folder, summary = sharded
    manifest = read_manifest(LocalStore(folder))
    assert len(manifest.shards) > 3 and manifest.count == 300 == summary.count
    seen = []
    for shard in manifest.shards:
        pack_ = open_pack(folder / shard.name)
        assert len(pack_) == shard.count
        assert (folder / shard.name).stat().st_size == shard.bytes
        seen += [int(pack_[i]["y"]) for i in range(len(pack_))]
        assert all(int(pack_[i]["x"][0, 0]) == int(pack_[i]["y"]) for i in range(len(pack_)))
    assert seen == list(range(300))


def test_shards_come_out_near_the_asked_size(tmp_path):
    pack(Fields(2000), tmp_path / "big", shard_size="200KB", workers=0)
    sizes = [s.bytes for s in read_manifest(LocalStore(tmp_path / "big")).shards]
    assert max(sizes[:-1]) <= 1.3 * 200_000 and min(sizes[:-1]) >= 0.5 * 200_000


def test_a_packer_that_fails_leaves_no_manifest_so_nothing_opens(tmp_path):
    calls = []

    class Breaks(Fields):
        def __getitem__(self, i):
            calls.append(i)
            if i == 250:
                raise RuntimeError("source broke")
            return super().__getitem__(i)

    with pytest.raises(RuntimeError, match="source broke"):
        pack(Breaks(), tmp_path / "out", shard_size="40KB", workers=0)
    assert any((tmp_path / "out").glob("shard-*"))  # shards were written ...
    with pytest.raises(FileNotFoundError, match="no manifest"):
        read_manifest(LocalStore(tmp_path / "out"))  # ... but the pack does not open


def test_overwriting_deletes_the_old_manifest_first_and_refuses_without_overwrite(sharded):
    folder, _ = sharded
    with pytest.raises(FileExistsError, match="already a sharded pack"):
        pack(Fields(), folder, shard_size="40KB", workers=0)
    pack(Fields(50), folder, shard_size="40KB", workers=0, overwrite=True)
    assert read_manifest(LocalStore(folder)).count == 50


def _manifest(folder) -> dict:
    return json.loads((folder / MANIFEST_NAME).read_text())


@pytest.mark.parametrize(
    ("field", "change", "message"),
    [
        ("shards[0].name", lambda m: m["shards"][0].update(name="../../etc/passwd"), "name"),
        ("shards[0].name", lambda m: m["shards"][0].update(name="/abs"), "plain file name"),
        ("shards[0].name", lambda m: m["shards"][0].update(name=".hidden"), "plain file name"),
        ("shards[1].name", lambda m: m["shards"][1].update(name=m["shards"][0]["name"]), "twice"),
        ("shards[0].count", lambda m: m["shards"][0].update(count=1 << 60), "outside"),
        ("shards[0].bytes", lambda m: m["shards"][0].update(bytes=-1), "outside"),
        ("shards[0].bytes", lambda m: m["shards"][0].update(bytes="big"), "must be an int"),
        ("shards[0].xxh3_64", lambda m: m["shards"][0].update(xxh3_64="zz"), "hex"),
        ("version", lambda m: m.update(version=99), "newer than this fastloader"),
        ("count", lambda m: m.update(count=m["count"] + 1), "sum"),
        ("backend", lambda m: m.update(backend="tfrecord"), "lmdb"),
        ("shards", lambda m: m.update(shards=[]), "non-empty"),
    ],
)
def test_an_untrusted_manifest_is_refused_naming_the_field(sharded, field, change, message):
    folder, _ = sharded
    value = _manifest(folder)
    change(value)
    with pytest.raises(ManifestError, match=rf"manifest field {_escape(field)}: .*{message}"):
        parse_manifest(json.dumps(value).encode(), str(folder / MANIFEST_NAME))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_manifest_too_deep_or_not_json_is_refused(tmp_path):
    with pytest.raises(ManifestError, match="corrupt manifest"):
        parse_manifest(b"[" * 100 + b"]" * 100, "m.json")
    with pytest.raises(ManifestError, match="corrupt manifest"):
        parse_manifest(b"{not json", "m.json")


def test_sizes_are_read_as_users_write_them():
    assert parse_size("64MB") == 64_000_000 and parse_size("1GiB") == 1 << 30
    assert parse_size(4096) == 4096
    for bad in ("64 parsecs", "-1MB", "0", True):
        with pytest.raises(ValueError, match="shard_size"):
            parse_size(bad, "shard_size")


def test_cli_packs_shards_and_info_and_verify_read_them(tmp_path, capsys):
    assert (
        cli.main(
            [
                str(_folder(tmp_path)),
                str(tmp_path / "out"),
                "--shard-size",
                "30KB",
                "--workers",
                "0",
                "-q",
            ]
        )
        == 0
    )
    assert cli.main(["--info", str(tmp_path / "out")]) == 0
    assert "shards of lmdb" in capsys.readouterr().out
    assert cli.main(["--verify", str(tmp_path / "out")]) == 0
    assert "OK" in capsys.readouterr().out


def _folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in "ab":
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(20):
            pixels = rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "src" / c / f"{i}.png")
    return tmp_path / "src"


def test_verify_names_a_corrupted_shard_and_fails(sharded, capsys):
    folder, _ = sharded
    manifest = read_manifest(LocalStore(folder))
    victim = folder / manifest.shards[2].name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert cli.main(["--verify", str(folder)]) == 1
    err = capsys.readouterr().err
    assert manifest.shards[2].name in err and "checksum" in err


class Named(Fields):
    """Fields plus a text field: a merged batch's list column."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "name": f"s{i}"}


class Ragged(Named):
    """Plus a ragged field, stored fixed in a shard whose values happen to share a length."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "r": np.arange(i // 7 % 3, dtype=np.int16)}


def test_a_batch_over_many_shards_reads_by_columns_as_the_samples_collate(tmp_path):
    # NOTE [ A sharded batch read by columns ]: the same batch as the samples, in batch order
    import torch

    from fastloader import DataLoader, ShardedDataset
    from fastloader.datasets.collate import default_collate

    pack(Named(), tmp_path / "named", shard_size="40KB", workers=0)
    pack(Ragged(), tmp_path / "ragged", shard_size="40KB", workers=0)
    order = np.random.default_rng(0).permutation(300)[:64].tolist()
    ragged = ShardedDataset(tmp_path / "ragged")
    assert len({ragged.shard_of(i) for i in order}) > 3
    merged = ragged.read_batch_columns(order).samples()
    for sample, index in zip(merged, order, strict=True):
        expected = ragged[index]
        assert list(sample) == list(expected) == ["x", "y", "name", "r"]
        assert all(np.array_equal(sample[k], expected[k]) for k in sample)
    dataset = ShardedDataset(tmp_path / "named")
    batch, expected = (
        default_collate(dataset.read_batch_columns(order)),
        default_collate([dataset[i] for i in order]),
    )
    assert torch.equal(batch["x"], expected["x"]) and torch.equal(batch["y"], expected["y"])
    assert batch["name"] == expected["name"] == [f"s{i}" for i in order]
    loader = DataLoader(dataset, batch_size=64, num_workers=1, shuffle=True, seed=0)
    with loader:
        seen = list(loader)
    ys = torch.cat([b["y"] for b in seen])
    assert sorted(ys.tolist()) == list(range(300)) and ys.tolist() != list(range(300))
    assert all(torch.equal(b["x"][:, 0, 0], b["y"].int()) for b in seen)
    assert [n for b in seen for n in b["name"]] == [f"s{i}" for i in ys.tolist()]


def test_a_target_a_few_times_a_packs_fixed_bytes_still_fills_its_shards(tmp_path):
    # NOTE [ Sizing shards ]: a column pack's ~32 KB of fixed bytes are not per-sample bytes
    # (counted as such, a 40 KB target gave shards of one sample)
    pack(Fields(), tmp_path / "out", shard_size="40KB", workers=0)
    shards = read_manifest(LocalStore(tmp_path / "out")).shards
    assert 4 <= len(shards) <= 12 and all(s.count >= 20 for s in shards[:-1])
    assert all(0.7 * 40_000 <= s.bytes <= 1.25 * 40_000 for s in shards[:-1])


def test_gs_urls_go_to_cloud_storages_s3_api_with_checksums_only_where_required(monkeypatch):
    # NOTE [ Cloud Storage through its S3 API ]: its endpoint, whatever AWS_ENDPOINT_URL says
    # for S3, and no CRC32 trailer on every upload; an s3:// store keeps botocore's defaults
    pytest.importorskip("boto3")
    from fastloader.shards.s3 import GCS_ENDPOINT

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("GS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("GS_SECRET_ACCESS_KEY", "secret")
    gs, s3 = open_store("gs://bucket/train/"), open_store("s3://bucket/train")
    assert (gs.url, gs.endpoint_url) == ("gs://bucket/train", GCS_ENDPOINT)
    assert (s3.url, s3.endpoint_url) == ("s3://bucket/train", "http://127.0.0.1:9")
    assert open_store("gs://b/p", endpoint_url="http://x:1").endpoint_url == "http://x:1"
    # at one endpoint each has a client of its own, made for it (botocore >= 1.36 has the
    # setting; older ones send no such checksums)
    both = [open_store(f"{scheme}://b/p", endpoint_url="http://x:1") for scheme in ("gs", "s3")]
    clients = [store._client() for store in (gs, s3, *both)]
    assert clients[2] is not clients[3]
    settings = [getattr(c.meta.config, "request_checksum_calculation", None) for c in clients]
    if settings[1] is not None:
        assert settings == ["when_required", "when_supported"] * 2
    with pytest.raises(ValueError, match="gs://bucket/prefix"):
        open_store("gs://")


@pytest.mark.parametrize("scheme", ["az", "abfss", "wasbs"])
def test_azure_urls_are_refused_naming_a_way_that_works(scheme):
    with pytest.raises(ValueError, match=f"{scheme}://.*no S3 API.*blobfuse2"):
        open_store(f"{scheme}://container/train")
