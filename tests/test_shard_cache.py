"""The node-local shard cache: one verified download per shard per node, a hard size limit with
least-recently-used eviction, locks that die with their process, nothing foreign deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fastloader import pack
from fastloader.formats.records import PackError
from fastloader.shards.cache import ShardCache, cache_minimum
from fastloader.shards.stores import LocalStore, read_manifest
from tests._fields import Indexed
from tests._remote_like import RemoteLike, downloads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "train"
    pack(Indexed(200), path, shard_size="48KB", workers=0)  # 13 shards
    return path


def _cache(source, cache_dir, limit=None, **store):
    remote = RemoteLike(source, **store)
    manifest = read_manifest(remote)
    biggest = max(s.bytes for s in manifest.shards)
    return ShardCache(remote, manifest, cache_dir, limit or 100 * biggest, biggest), manifest


def test_a_shard_is_downloaded_once_verified_and_then_read_from_the_cache(source, tmp_path):
    log = tmp_path / "log"
    cache, manifest = _cache(source, tmp_path / "cache", log=log)
    shard = manifest.shards[3]
    path = cache.ensure(shard)
    assert path.read_bytes() == (source / shard.name).read_bytes()
    assert cache.ensure(shard) == path
    assert downloads(log) == [shard.name]
    assert cache.stats.hits == 1 and cache.stats.misses == 1
    assert cache.stats.bytes_downloaded == shard.bytes


def test_a_limit_below_the_orders_working_set_is_refused_naming_the_minimum(source, tmp_path):
    remote = RemoteLike(source)
    manifest = read_manifest(remote)
    minimum = cache_minimum(16384, 50, 8, 4, 2)
    assert minimum == min(50, 8 * 4 + 2) * 16384
    with pytest.raises(ValueError, match=rf"at least .*\({minimum} bytes"):
        ShardCache(remote, manifest, tmp_path, minimum - 1, minimum)


def test_the_limit_holds_and_least_recently_read_shards_go_first(source, tmp_path):
    sizes = [s.bytes for s in read_manifest(LocalStore(source)).shards]
    common = max(set(sizes), key=sizes.count)
    cache, manifest = _cache(source, tmp_path / "c", limit=3 * common)
    big = [s for s in manifest.shards if s.bytes == common]
    first = big[:3]
    for shard in first:
        cache.ensure(shard)
        time.sleep(0.02)
    os.utime(cache.path(first[0]))  # read again: now the most recent
    cache.ensure(big[3])
    held = {p.name for p in cache.folder.iterdir() if not p.name.startswith(".")}
    assert held == {first[0].name, first[2].name, big[3].name}
    for shard in manifest.shards:
        cache.ensure(shard)
        total = sum(cache.path(s).stat().st_size for s in manifest.shards if cache.path(s).exists())
        assert total <= 3 * common


def test_the_cache_never_deletes_what_it_did_not_download(source, tmp_path):
    biggest = max(s.bytes for s in read_manifest(LocalStore(source)).shards)
    cache, manifest = _cache(source, tmp_path / "c", limit=2 * biggest)
    mine = cache.folder / "notes.txt"
    mine.write_bytes(b"x" * 10)
    for shard in manifest.shards[:6]:
        cache.ensure(shard)
    assert mine.read_bytes() == b"x" * 10


def test_a_damaged_download_is_fetched_once_more_then_refused_and_never_placed(source, tmp_path):
    log = tmp_path / "log"
    cache, manifest = _cache(source, tmp_path / "c", log=log, damage=["shard-00002.lmdb"])
    with pytest.raises(PackError, match="shard-00002.lmdb.*do not match the manifest"):
        cache.ensure(manifest.shards[2])
    assert downloads(log) == ["shard-00002.lmdb"] * 2
    assert not cache.path(manifest.shards[2]).exists()
    assert not list(cache.folder.glob(".shard-00002*partial*"))


_RACE = """
import sys
sys.path.insert(0, {repo!r})
from tests.test_shard_cache import _cache
from pathlib import Path
cache, manifest = _cache(Path({source!r}), {cache_dir!r}, log={log!r}, slow={slow})
for shard in manifest.shards[:{count}]:
    cache.ensure(shard)
print("done", flush=True)
"""


def _start(source, tmp_path, slow=0.0, count=6):
    code = _RACE.format(
        repo=REPO,
        source=str(source),
        cache_dir=str(tmp_path / "c"),
        log=str(tmp_path / "log"),
        slow=slow,
        count=count,
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_two_loaders_racing_on_one_cache_download_each_shard_once(source, tmp_path):
    racers = [_start(source, tmp_path, slow=0.05) for _ in range(3)]
    for racer in racers:
        out, _ = racer.communicate(timeout=120)
        assert racer.returncode == 0 and "done" in out
    names = downloads(tmp_path / "log")
    assert sorted(names) == sorted({*names}) and len(names) == 6


def test_sigkill_mid_download_leaves_no_stale_lock_and_no_half_shard_used(source, tmp_path):
    victim = _start(source, tmp_path, slow=60, count=1)
    deadline = time.monotonic() + 60
    partial = []
    while not partial and time.monotonic() < deadline:
        partial = list((tmp_path / "c").glob("*/.shard-00000.lmdb.partial-*"))
        time.sleep(0.05)
    assert partial, "the download never started"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    cache, manifest = _cache(source, tmp_path / "c")
    started = time.monotonic()
    path = cache.ensure(manifest.shards[0])  # would block forever on a stale lock
    assert time.monotonic() - started < 30
    assert path.read_bytes() == (source / manifest.shards[0].name).read_bytes()
    assert not list(cache.folder.glob(".shard-00000.lmdb.partial-*"))


def test_the_cache_pickles_without_its_thread_or_locks(source, tmp_path):
    import pickle

    cache, manifest = _cache(source, tmp_path / "c")
    cache.plan(np.array([0, 0, 1, 2]), ahead=1)
    copy = pickle.loads(pickle.dumps(cache))
    assert copy._threads == [] and copy.folder == cache.folder
    cache.stop()


def test_a_full_disk_while_downloading_names_the_cache_and_leaves_no_partial(source, tmp_path):
    import errno

    from fastloader.shards.cache import CacheFullError

    class FullDisk(RemoteLike):
        def download(self, name, dest, size=None):
            dest.write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

    manifest = read_manifest(LocalStore(source))
    cache = ShardCache(FullDisk(source), manifest, tmp_path / "c", 1 << 30, 1)
    with pytest.raises(CacheFullError, match=r"disk is full while downloading .*shard-00001"):
        cache.ensure(manifest.shards[1])
    assert (
        not list(cache.folder.glob(".shard-00001*")) and not cache.path(manifest.shards[1]).exists()
    )


def _child_takes_the_lock(path, released, result):
    import fcntl

    from fastloader.shards.cache import _locked

    released.wait(30)
    with _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
        result.put(taken)


def test_a_child_forked_while_its_parent_holds_a_lock_does_not_keep_it(tmp_path):
    """NOTE [ Lock files across a fork ]: the parent's lock ends when the parent releases it,
    whatever children it forked meanwhile."""
    import multiprocessing

    from fastloader.shards.cache import _locked

    context = multiprocessing.get_context("fork")
    released, result = context.Event(), context.Queue()
    lock = tmp_path / "x.lock"
    with _locked(lock) as taken:
        assert taken
        child = context.Process(target=_child_takes_the_lock, args=(lock, released, result))
        child.start()
    released.set()  # the parent's lock is gone: the child must get it
    assert result.get(timeout=30) is True
    child.join(30)


def test_a_process_key_names_one_process_as_it_names_itself():
    from fastloader.shards.cache_counters import process_key

    code = (
        "import sys; from fastloader.shards.cache_counters import process_key\n"
        "print(process_key(), flush=True); sys.stdin.readline()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        own = child.stdout.readline().strip()
        assert process_key(child.pid) == own and own != process_key()
        assert own.rsplit("-", 1)[1] != "0"  # a start time, read from /proc
    finally:
        child.communicate("\n", timeout=60)
    assert process_key(child.pid) != own  # ended: not the same process any more
