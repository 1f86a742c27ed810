"""Sharded packs in a real S3-compatible server (SeaweedFS on 127.0.0.1, benchmarks/_seaweed.py):
packed, verified, read back equal, corrupted shards refused, elastic resume, fork and spawn,
no credentials in errors or states."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import boto3
import numpy as np
import pytest

from fastloader import DataLoader, ShardedDataset, ShardOrderSampler, cli, pack
from fastloader.formats.records import PackError
from fastloader.shards.stores import open_store, read_manifest
from tests import _seaweed
from tests._fields import Indexed
from tests.conftest import S3_BUCKET

SEED = 3
BUCKET = S3_BUCKET  # the s3 fixture (tests/conftest.py) makes it
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def url(s3):
    target = f"s3://{BUCKET}/train"
    pack(Indexed(300), target, shard_size="48KB", workers=0)
    return target


def _ys(batch) -> list[int]:
    return [int(y) for y in batch["y"]]


def test_packed_to_the_server_every_sample_reads_back_equal(url, tmp_path):
    dataset = ShardedDataset(url, cache_dir=tmp_path, cache_limit="64MB")  # it holds them all
    assert len(dataset) == 300
    assert [int(dataset[i]["x"][0, 0]) for i in range(300)] == list(range(300))
    assert dataset.cache.stats.downloads == len(dataset.manifest.shards)
    stats = dataset.cache_stats()  # every process of the node: here one
    assert stats.bytes_downloaded == dataset.manifest.size_bytes and stats.hit_rate < 1
    again = ShardedDataset(url, cache_dir=tmp_path, cache_limit="64MB")  # the node's cache
    assert [int(s["y"]) for s in again.__getitems__(list(range(300)))] == list(range(300))
    assert again.cache.stats.downloads == 0


def test_info_and_verify_read_a_url(url, capsys):
    assert cli.main(["--info", url]) == 0
    assert "shards of lmdb" in capsys.readouterr().out
    assert cli.main(["--verify", url]) == 0
    assert "OK" in capsys.readouterr().out


def test_a_corrupted_shard_on_the_server_is_refused_naming_it(s3, tmp_path, capsys):
    target = f"s3://{BUCKET}/damaged"
    pack(Indexed(100), target, shard_size="48KB", workers=0)
    manifest = read_manifest(open_store(target))
    name = manifest.shards[1].name
    client = boto3.client("s3")
    data = bytearray(client.get_object(Bucket=BUCKET, Key=f"damaged/{name}")["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=f"damaged/{name}", Body=bytes(data))
    dataset = ShardedDataset(target, cache_dir=tmp_path)
    first = manifest.shards[0].count
    with pytest.raises(PackError, match=f"{name}: its bytes do not match"):
        dataset[first]
    assert int(dataset[0]["y"]) == 0  # the other shards still read
    assert cli.main(["--verify", target]) == 1
    assert name in capsys.readouterr().err


def _loaders(url, cache, world, batch, workers=0, context=None):
    dataset = ShardedDataset(url, cache_dir=cache)
    return [
        DataLoader(
            dataset,
            batch_size=batch,
            num_workers=workers,
            multiprocessing_context=context,
            sampler=ShardOrderSampler(dataset, batch, world, rank, seed=SEED),
            seed=SEED,
        )
        for rank in range(world)
    ]


def test_exact_resume_across_world_sizes_from_remote_shards(url, tmp_path):
    first = _loaders(url, tmp_path / "a", 4, 6)
    iterators = [iter(loader) for loader in first]
    seen = [y for _ in range(5) for it in iterators for y in _ys(next(it))]
    state = first[0].state_dict()
    assert state["position"] == 120
    resumed = _loaders(url, tmp_path / "b", 3, 5, workers=2)  # forked workers, fresh cache
    for loader in resumed:
        loader.load_state_dict(state)
        seen += [y for batch in loader for y in _ys(batch)]
        loader.close()
    assert sorted(seen) == list(range(300))
    # 3 ranks x (2 workers + the download-ahead thread) on one node: each shard fetched once
    stats = resumed[0].dataset.cache_stats()
    manifest = resumed[0].dataset.manifest
    assert 0 < stats.downloads <= len(manifest.shards)
    assert stats.bytes_downloaded <= manifest.size_bytes


def test_spawned_workers_make_their_own_client(url, tmp_path):
    loader = _loaders(url, tmp_path, 1, 50, workers=1, context="spawn")[0]
    assert sorted(y for batch in loader for y in _ys(batch)) == list(range(300))
    loader.close()


_FORK_WHILE_MAKING = """
import os, sys
from fastloader.shards import s3
store = s3.S3Store("s3://bucket/prefix", endpoint_url="http://127.0.0.1:9")
parents = store._client()
s3._MAKING.acquire()  # as a thread of the parent making a client when a worker is forked
pid = os.fork()
if pid == 0:
    os._exit(0 if store._client() is not parents else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_worker_forked_while_its_parent_makes_a_client_makes_its_own(tmp_path):
    """NOTE [ One client per process ]: the child keeps the parent's parsed models, never its
    client, and never waits on a lock a thread of the parent's held at the fork."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_MAKING], timeout=60, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_credentials_never_appear_in_states_pickles_or_errors(url, tmp_path):
    loader = _loaders(url, tmp_path, 1, 10)[0]
    next(iter(loader))
    secret = _seaweed.SECRET_KEY
    assert secret not in repr(loader.state_dict()) and secret not in repr(loader.dataset)
    assert secret.encode() not in pickle.dumps(loader.dataset)
    with pytest.raises(FileNotFoundError) as error:
        ShardedDataset(f"s3://{BUCKET}/nothing-here", cache_dir=tmp_path)
    assert secret not in str(error.value) and "s3://fastloader-tests/nothing-here" in str(
        error.value
    )


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_missing_credentials_say_what_to_set(url, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=os.environ["AWS_ENDPOINT_URL"],
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
        PYTHONPATH=os.getcwd(),
    )
    run = _run(f"import fastloader; fastloader.ShardedDataset({url!r})", env)
    assert run.returncode != 0
    assert "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in run.stderr


def test_a_gs_url_reads_the_same_samples_through_the_s3_api(url, tmp_path, monkeypatch):
    # the loopback server stands in for Cloud Storage's XML API (its endpoint given), with the
    # HMAC key in GS_* (NOTE [ Cloud Storage through its S3 API ])
    gcs = url.replace("s3://", "gs://")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("GS_ACCESS_KEY_ID", _seaweed.ACCESS_KEY)
    monkeypatch.setenv("GS_SECRET_ACCESS_KEY", _seaweed.SECRET_KEY)
    dataset = ShardedDataset(gcs, cache_dir=tmp_path, endpoint_url=endpoint)
    assert [int(s["y"]) for s in dataset.__getitems__(list(range(300)))] == list(range(300))
    assert dataset.cache.stats.downloads == len(dataset.manifest.shards)
    config = dataset.store._client().meta.config  # its own client, not the s3:// stores'
    assert getattr(config, "request_checksum_calculation", "when_required") == "when_required"
    with pytest.raises(FileNotFoundError, match=f"gs://{BUCKET}/nothing-here/manifest.json"):
        ShardedDataset(f"gs://{BUCKET}/nothing-here", cache_dir=tmp_path, endpoint_url=endpoint)


def test_a_gs_url_never_takes_the_aws_credentials_and_says_what_to_set(url, tmp_path):
    # AWS's keys are in the environment (the fixture's): a gs:// URL must not send them to
    # Google, but ask for its own HMAC key
    gcs, endpoint = url.replace("s3://", "gs://"), os.environ["AWS_ENDPOINT_URL"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GS_")}
    env.update(PYTHONPATH=os.getcwd())
    run = _run(
        f"import fastloader; fastloader.ShardedDataset({gcs!r}, endpoint_url={endpoint!r})", env
    )
    assert run.returncode != 0 and "no Cloud Storage HMAC key" in run.stderr
    assert "set GS_ACCESS_KEY_ID and GS_SECRET_ACCESS_KEY" in run.stderr
    assert _seaweed.SECRET_KEY not in run.stderr
    # a wrong HMAC key beside the right AWS keys: refused, naming the key that was used
    env.update(GS_ACCESS_KEY_ID="not-a-key", GS_SECRET_ACCESS_KEY="not-a-secret")
    run = _run(
        f"import fastloader; fastloader.ShardedDataset({gcs!r}, endpoint_url={endpoint!r})", env
    )
    assert run.returncode != 0 and "PermissionError" in run.stderr
    assert "check the Cloud Storage HMAC key (GS_ACCESS_KEY_ID)" in run.stderr
    assert "not-a-secret" not in run.stderr and _seaweed.SECRET_KEY not in run.stderr


def test_a_url_without_the_remote_extra_names_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['boto3'] = None\n"
        "from fastloader.shards.stores import open_store\n"
        "open_store('s3://bucket/x')"
    )
    run = _run(code, dict(os.environ, PYTHONPATH=os.getcwd()))
    assert "fastloader[remote]" in run.stderr and run.returncode != 0


def test_a_server_gone_for_good_is_a_clear_error_naming_the_url_not_a_hang(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    code = (
        "from fastloader.shards.s3 import S3Store\n"
        "store = S3Store('s3://b/x', endpoint_url='http://127.0.0.1:9', retries=2, timeout=2)\n"
        "store.read_bytes('manifest.json', 100)"
    )
    run = _run(code, env)
    assert run.returncode != 0
    assert "ConnectionError: s3://b/x/manifest.json at http://127.0.0.1:9" in run.stderr


@pytest.fixture
def proxy(s3):
    from benchmarks._fault_proxy import FaultProxy

    proxy = FaultProxy(s3.endpoint)
    yield proxy
    proxy.close()


def _through(proxy, url, tmp_path, **options):
    return ShardedDataset(url, cache_dir=tmp_path, endpoint_url=proxy.endpoint, **options)


def test_a_503_storm_is_retried_and_every_sample_arrives(url, proxy, tmp_path):
    proxy.add("503", count=5)
    dataset = _through(proxy, url, tmp_path)
    assert [int(s["y"]) for s in dataset.__getitems__(list(range(300)))] == list(range(300))
    assert sum(done == "503" for _, done in proxy.served) == 5


def test_bodies_cut_off_mid_shard_are_fetched_again_from_where_they_stopped(url, proxy, tmp_path):
    dataset = _through(proxy, url, tmp_path)
    proxy.add("cut", count=3, match="shard-0000", argument=3000)
    assert [int(s["y"]) for s in dataset.__getitems__(list(range(300)))] == list(range(300))
    cut = [line for line, done in proxy.served if done == "cut"]
    assert len(cut) == 3
    ranged = [line for line, done in proxy.served if done == "forwarded" and "shard-0000" in line]
    assert ranged  # the rest of each cut body came in another request


def test_a_body_cut_and_resumed_is_hashed_as_the_bytes_written(url, proxy, tmp_path):
    """NOTE [ Hashed on the way ]: the digest the store returns is the file's, cut or not."""
    from fastloader.shards.manifest import file_checksum

    dataset = _through(proxy, url, tmp_path)
    shard = dataset.manifest.shards[0]
    proxy.add("cut", count=2, match=shard.name, argument=3000)
    digest = dataset.store.download(shard.name, tmp_path / "shard", size=shard.bytes)
    assert sum(done == "cut" for _, done in proxy.served) == 2
    assert digest == file_checksum(tmp_path / "shard") == shard.xxh3_64
    wrong = tmp_path / "wrong"
    assert dataset.store.download(dataset.manifest.shards[1].name, wrong) != shard.xxh3_64


def test_a_large_shard_comes_in_parallel_ranges_and_a_cut_range_resumes(url, proxy, tmp_path):
    # NOTE [ Parallel ranged GETs ]: 4 ranges of a ~48 KB shard (ranges of at least 4 KB here)
    dataset = _through(proxy, url, tmp_path, store_options={"ranges": 4, "range_min": 4096})
    shard = dataset.manifest.shards[1]
    proxy.add("cut", count=2, match=shard.name, argument=3000)
    assert [int(s["y"]) for s in dataset.__getitems__(list(range(300)))] == list(range(300))
    bounds = [shard.bytes * k // 4 for k in range(5)]
    wanted = [f"bytes={a}-{b - 1}" for a, b in zip(bounds, bounds[1:], strict=False)]
    asked = [header for line, header in proxy.ranges if shard.name in line]
    assert set(wanted) <= set(asked) and len(asked) == 4 + 2
    # each cut range fetched again alone, from where its bytes stopped arriving: not the shard
    for header in asked:
        start, last = (int(v) for v in header[len("bytes=") :].split("-"))
        assert any(a <= start and last == b - 1 for a, b in zip(bounds, bounds[1:], strict=False))
    assert dataset.cache_stats().downloads == len(dataset.manifest.shards)


def test_a_stalled_server_times_out_and_is_retried(url, proxy, tmp_path):
    from fastloader.shards.s3 import S3Store

    store = S3Store(url, endpoint_url=proxy.endpoint, retries=3, timeout=1.0)
    proxy.add("stall", count=1, match="manifest", argument=4.0)
    assert store.read_bytes("manifest.json", 1 << 20).startswith(b"{")


def test_dropped_connections_are_retried(url, proxy, tmp_path):
    proxy.add("drop", count=3)
    dataset = _through(proxy, url, tmp_path)
    assert int(dataset[299]["y"]) == 299


def test_a_server_stopped_mid_epoch_and_started_again_completes_the_epoch(
    s3, tmp_path, monkeypatch
):
    import threading

    server = _seaweed.start(tmp_path / "own")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        boto3.client("s3").create_bucket(Bucket="restarts")
        target = "s3://restarts/train"
        pack(Indexed(120), target, shard_size="48KB", workers=0)
        dataset = ShardedDataset(target, cache_dir=tmp_path / "c", endpoint_url=server.endpoint)
        first = [int(s["y"]) for s in dataset.__getitems__(list(range(40)))]
        _seaweed.stop(server)
        restarted = []
        later = threading.Timer(
            1.0, lambda: restarted.append(_seaweed.start(tmp_path / "own", ports=server.ports))
        )
        later.start()
        rest = [int(s["y"]) for s in dataset.__getitems__(list(range(40, 120)))]
        later.join()
        server = restarted[0]
    finally:
        _seaweed.stop(server)
    assert first + rest == list(range(120))


class Local:
    """A local source with the remote one's fields."""

    def __len__(self) -> int:
        return 90

    def __getitem__(self, i: int) -> dict:
        return {"x": np.full((16, 16), -i, np.int32), "y": 1000 + i}


def _mix_loaders(url, cache, world, batch, workers=0):
    from fastloader import Mix
    from fastloader.sampling.mix_samplers import ElasticMixSampler

    mix = Mix(
        {"remote": ShardedDataset(url, cache_dir=cache), "local": Local()},
        {"remote": 0.7, "local": 0.3},
        samples_per_epoch=200,
    )
    return [
        DataLoader(
            mix,
            batch_size=batch,
            num_workers=workers,
            sampler=ElasticMixSampler(mix, batch, world, rank),
            seed=SEED,
        )
        for rank in range(world)
    ]


def _mixed(batch) -> list[tuple[str, int]]:
    return list(zip(batch.source, batch.index.tolist(), strict=True))


def test_a_mix_of_a_remote_and_a_local_source_resumes_exactly_on_another_world(url, tmp_path):
    whole = [r for b in _mix_loaders(url, tmp_path / "w", 1, 10)[0] for r in _mixed(b)]
    first = _mix_loaders(url, tmp_path / "a", 4, 5)
    iterators = [iter(loader) for loader in first]
    seen = [r for _ in range(3) for it in iterators for r in _mixed(next(it))]
    state = first[0].state_dict()
    assert state["position"] == 60
    for loader in _mix_loaders(url, tmp_path / "b", 3, 4, workers=2):
        loader.load_state_dict(state)
        seen += [r for batch in loader for r in _mixed(batch)]
        loader.close()
    assert sorted(seen) == sorted(whole) and len(whole) == 200
    assert {source for source, _ in whole} == {"remote", "local"}
