"""Packs bigger than memory: read advice, block shuffle, a compact epoch order, the I/O probe."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, RandomSampler

from fastloader import DataLoader, HDF5Dataset, LMDBDataset
from fastloader.formats import RecordKind, encode_record, open_writer
from fastloader.formats import advice as advice_module
from fastloader.formats.advice import ReadAdvice, page_ranges
from fastloader.sampling.samplers import BlockShuffleSampler, EpochShuffleSampler, epoch_generator
from fastloader.stats.io_probe import IOCounters, io_verdict, read_counters, sum_counters

FORMATS = {"lmdb": (".lmdb", LMDBDataset), "hdf5": (".h5", HDF5Dataset)}
PAGE = mmap.PAGESIZE
SHAPE = (40, 50, 3)  # 6000 bytes: records span pages, and start anywhere in HDF5


def _pixels(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, SHAPE, dtype=np.uint8)


def _write(path, fmt: str, count: int, shape=SHAPE) -> None:
    with open_writer(path, fmt, store="raw", classes=["a", "b"]) as writer:
        for index in range(count):
            pixels = np.random.default_rng(index).integers(0, 256, shape, dtype=np.uint8)
            writer.append(encode_record(pixels, index % 2, RecordKind.RAW), index % 2)


@pytest.fixture(params=sorted(FORMATS))
def pack(request, tmp_path):
    suffix, reader = FORMATS[request.param]
    path = tmp_path / f"pack{suffix}"
    _write(path, request.param, 300)
    return reader(path, decode="numpy")


@pytest.fixture
def small_memory(monkeypatch):
    """As if the page cache could hold 64 KB: every pack here is bigger than memory."""
    monkeypatch.setattr(advice_module, "memory_for_cache", lambda: 64 << 10)


@pytest.fixture
def madvise_calls(monkeypatch, small_memory):
    calls = []
    real = advice_module._madvise

    def spy(file, option, *where):
        calls.append((option, *where))
        real(file, option, *where)

    monkeypatch.setattr(advice_module, "_madvise", spy)
    return calls


def _record_spans(pack, positions):
    file, spans = pack._record_spans(pack._handle_here(), positions, ReadAdvice())
    return file, list(spans)


# --- read advice ------------------------------------------------------------------------------
def test_random_batches_advise_random_access_and_each_record_willneed(pack, madvise_calls):
    order = np.random.default_rng(0).permutation(len(pack))[:64].tolist()
    samples = pack.__getitems__(order)
    assert all(
        np.array_equal(image, _pixels(i)) for (image, _), i in zip(samples, order, strict=True)
    )
    options = [call[0] for call in madvise_calls]
    assert options.count(mmap.MADV_RANDOM) == 1 and mmap.MADV_NORMAL not in options
    willneed = [call[1:] for call in madvise_calls if call[0] == mmap.MADV_WILLNEED]
    assert willneed and all(start % PAGE == 0 and length > 0 for start, length in willneed)
    _, spans = _record_spans(pack, order)
    for offset, length in spans:  # every byte of every record was asked for
        assert any(s <= offset and offset + length <= s + n for s, n in _merged(willneed))


def _merged(ranges):
    merged = []
    for start, length in sorted(ranges):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
        else:
            merged.append([start, length])
    return merged


def test_lmdb_leaves_are_asked_for_together(tmp_path, madvise_calls):
    path = tmp_path / "pack.lmdb"
    _write(path, "lmdb", 600)  # overflow records: ~150 leaf nodes a page, under one branch
    pack = LMDBDataset(path, decode="numpy")
    data, psize = path.read_bytes(), 4096
    headers = [struct.unpack_from("<QHH", data, page * psize) for page in range(len(data) // psize)]
    leaves = [page for page, (pgno, _, flags) in enumerate(headers) if (pgno, flags) == (page, 2)]
    assert len(leaves) >= 3
    pack.__getitems__(np.random.default_rng(4).permutation(600)[:64].tolist())
    willneed = [call[1:] for call in madvise_calls if call[0] == mmap.MADV_WILLNEED]
    for leaf in leaves:  # each leaf was asked for, whether or not this batch reads it
        assert any(s <= leaf * psize < s + n for s, n in willneed)


def test_sequential_reading_keeps_read_ahead(pack, madvise_calls):
    for start in range(0, 256, 64):
        pack.__getitems__(list(range(start, start + 64)))
    assert not [call for call in madvise_calls if call[0] == mmap.MADV_RANDOM]
    shuffled = np.random.default_rng(1).permutation(len(pack))[:128].tolist()
    pack.__getitems__(shuffled[:64])
    pack.__getitems__(shuffled[64:])
    assert [call[0] for call in madvise_calls].count(mmap.MADV_RANDOM) == 1
    for _ in range(6):  # back in order: read-ahead again
        pack.__getitems__(list(range(0, 64)))
    assert [call[0] for call in madvise_calls if call[0] != mmap.MADV_WILLNEED][-1] == (
        mmap.MADV_NORMAL
    )


def test_willneed_pauses_while_cached_and_resumes_when_reads_miss(monkeypatch, small_memory):
    counters = {"faults": 0, "read": 0}
    monkeypatch.setattr(advice_module, "_thread_major_faults", lambda: counters["faults"])
    monkeypatch.setattr(advice_module, "_thread_read_bytes", lambda: counters["read"])
    calls = []
    monkeypatch.setattr(
        advice_module, "_madvise", lambda file, option, *where: calls.append(option)
    )
    advice, file = ReadAdvice(), bytearray(1 << 20)  # 1 MB: bigger than the 64 KB "memory"
    batches = [list(range(start, start + 8)) for start in range(0, 800, 8)]
    for batch in batches[:4]:  # WILLNEED reads nothing: the pack is cached
        advice.before_read(file, batch, [(0, 100)])
    assert calls.count(mmap.MADV_WILLNEED) == 4 and advice.willneed_paused
    advice.before_read(file, batches[4], [(0, 100)])
    assert calls.count(mmap.MADV_WILLNEED) == 4  # paused
    counters["faults"] += 3  # the last batch's reads waited for storage
    advice.before_read(file, batches[5], [(0, 100)])
    assert calls.count(mmap.MADV_WILLNEED) == 5 and not advice.willneed_paused


def test_a_pack_that_fits_in_memory_keeps_the_kernels_read_ahead(pack, monkeypatch):
    calls = []
    monkeypatch.setattr(advice_module, "_madvise", lambda *args: calls.append(args))
    monkeypatch.setattr(advice_module, "memory_for_cache", lambda: 1 << 40)
    pack.__getitems__(np.random.default_rng(2).permutation(len(pack))[:64].tolist())
    assert calls == [] and pack._advice[1].bigger_than_memory is False


def test_memory_for_cache_is_sane():
    memory = advice_module.memory_for_cache()
    if memory is None:
        pytest.skip("no /proc/meminfo here")
    assert 1 << 20 < memory < 1 << 50


def test_read_advice_off_advises_nothing(pack, madvise_calls):
    pack.read_advice = False
    pack.__getitems__(np.random.default_rng(2).permutation(len(pack))[:64].tolist())
    assert madvise_calls == []


def test_shuffled_loader_with_workers_reads_every_record_intact(pack, small_memory):
    pack.transform = None
    loader = DataLoader(pack, batch_size=32, shuffle=True, num_workers=2, seed=3)
    seen = []
    for images, labels in loader:
        for image, label in zip(images, labels, strict=True):
            index = _find(image.numpy())
            assert label == index % 2
            seen.append(index)
    loader.close()
    assert sorted(seen) == list(range(len(pack)))


def _find(image: np.ndarray) -> int:
    for index in range(300):
        if np.array_equal(image, _pixels(index)):
            return index
    raise AssertionError("a sample that is no record")


def test_page_ranges_are_aligned_merged_and_cut():
    size = 10 * (128 << 10)
    ranges = page_ranges([(5000, 100), (5050, 5000), (1, 10), (size - 1, 5), (-1, 3)], size)
    assert ranges == [(0, -(-10050 // PAGE) * PAGE)]  # whole pages, merged; outside: dropped
    long = page_ranges([(PAGE + 7, 300 << 10)], size)
    assert all(start % PAGE == 0 and length <= 128 << 10 for start, length in long)
    end = PAGE + 7 + (300 << 10)
    assert long[0][0] == PAGE and PAGE + sum(length for _, length in long) == end + -end % PAGE


def test_advice_is_decided_from_steps_not_from_one_index():
    advice = ReadAdvice()
    assert advice.observe([5]) is False  # too few steps to tell
    assert advice.observe([7, 2, 90, 40, 13, 77, 1, 60, 33]) is True
    assert advice.observe(range(100, 400)) is False  # in order again (workers interleave)
    assert advice.observe(range(1000, 3000, 16)) is False  # one worker's share of an order


# --- block shuffle ----------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "block", "window"), [(1000, 16, 4), (997, 64, 8), (5, 64, 8)])
def test_block_shuffle_yields_every_index_once_from_seed_and_epoch(n, block, window):
    sampler = BlockShuffleSampler(range(n), seed=7, block_size=block, window=window)
    first = list(sampler)
    assert sorted(first) == list(range(n)) and len(sampler) == n
    again = BlockShuffleSampler(range(n), seed=7, block_size=block, window=window)
    assert list(again) == first
    sampler.set_epoch(1)
    if n > block:
        assert list(sampler) != first
        other = BlockShuffleSampler(range(n), seed=8, block_size=block, window=window)
        assert list(other) != first


def test_block_shuffle_resumes_from_any_position():
    sampler = BlockShuffleSampler(range(1000), seed=1, block_size=16, window=4)
    sampler.set_epoch(3)
    order = list(sampler)
    for start in (0, 1, 15, 16, 63, 64, 500, 999, 1000):
        assert list(sampler.iter_from(start)) == order[start:]


def test_block_shuffle_is_as_random_as_stated():
    sampler = BlockShuffleSampler(range(64 * 400), seed=0, block_size=64, window=8)
    order = np.array(list(sampler))
    same = np.mean(order[1:] // 64 == order[:-1] // 64)
    assert abs(same - sampler.same_block_probability()) < 0.02
    assert same > 50 * (1 / len(order))  # far less random than a full shuffle, as stated
    window = 64 * 8  # records of a window stay together
    assert all(
        len(np.unique(order[i : i + window] // 64)) == 8 for i in range(0, 8 * window, window)
    )
    with pytest.raises(ValueError, match="block_size"):
        BlockShuffleSampler(range(10), seed=0, block_size=0)


class _Index(Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, index):
        return index


@pytest.mark.parametrize("workers", [0, 2])
def test_block_shuffle_resumes_exactly_in_the_loader(workers):
    def loader():
        sampler = BlockShuffleSampler(_Index(), seed=5, block_size=8, window=3)
        return DataLoader(_Index(), batch_size=10, sampler=sampler, num_workers=workers, seed=5)

    full = loader()
    expected = [batch.tolist() for _ in range(2) for batch in full]
    full.close()
    first = loader()
    seen = []
    for batch in first:
        seen.append(batch.tolist())
        if len(seen) == 7:
            break
    state = first.state_dict()
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch in resumed] + [batch.tolist() for batch in resumed]
    resumed.close()
    assert seen + rest == expected
    assert expected[:20] != expected[20:]  # each epoch its own order


# --- compact epoch order ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "kwargs"),
    [(1, {}), (10, {}), (100_003, {}), (100, {"num_samples": 250}), (100, {"num_samples": 30})],
)
def test_compact_order_is_the_order_states_were_saved_with(n, kwargs):
    sampler = EpochShuffleSampler(range(n), seed=11, **kwargs)
    sampler.set_epoch(4)
    torch_order = list(RandomSampler(range(n), generator=epoch_generator(11, 4), **kwargs))
    assert list(sampler) == torch_order
    for start in (0, 1, n // 2, len(torch_order)):
        assert list(sampler.iter_from(start)) == torch_order[start:]


def test_compact_order_with_replacement_is_unchanged():
    sampler = EpochShuffleSampler(range(50), seed=2, replacement=True, num_samples=77)
    expected = list(RandomSampler(range(50), True, 77, generator=epoch_generator(2, 0)))
    assert list(sampler) == expected and list(sampler.iter_from(40)) == expected[40:]


def test_int32_and_int64_permutations_agree():
    for n in (2, 1000, 3_000_017):
        a = torch.randperm(n, generator=epoch_generator(0, n), dtype=torch.int32)
        b = torch.randperm(n, generator=epoch_generator(0, n))
        assert torch.equal(a.long(), b)


# --- the I/O probe ----------------------------------------------------------------------------
needs_proc_io = pytest.mark.skipif(
    read_counters().read_bytes is None, reason="no /proc/self/io here"
)


def test_probe_reads_sane_counters():
    before = read_counters()
    sum(i * i for i in range(300_000))
    after = read_counters()
    assert after.cpu_seconds is not None and after.cpu_seconds >= before.cpu_seconds
    assert after.major_faults is not None and after.major_faults >= before.major_faults
    gone = read_counters(2**22 + 12345)  # no such process: nothing raises
    assert gone in (IOCounters(None, None, None), read_counters(2**22 + 12345))


@needs_proc_io
def test_probe_sums_other_processes():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        counters = sum_counters([child.pid, child.pid])
        single = read_counters(child.pid)
        assert counters.read_bytes == 2 * single.read_bytes
        assert counters.cpu_seconds >= 0 and counters.major_faults >= 0
    finally:
        child.communicate(b"")


def test_verdict_names_io_only_when_the_disk_is_what_waits():
    waiting = IOCounters(read_bytes=1000 * 300_000, major_faults=5000, cpu_seconds=2.0)
    text = io_verdict(waiting, samples=1000, seconds=10, processes=2, record_bytes=260_000)
    assert text and "input-bound on I/O" in text and "does not fit in memory" in text
    amplified = io_verdict(
        IOCounters(1000 * 6_000_000, 9000, 2.0), 1000, 10, 2, record_bytes=260_000
    )
    assert "read-ahead" in amplified
    cached = IOCounters(read_bytes=0, major_faults=0, cpu_seconds=2.0)
    assert io_verdict(cached, 1000, 10, 2, 260_000) is None
    busy = IOCounters(read_bytes=1000 * 300_000, major_faults=5000, cpu_seconds=19.0)
    assert io_verdict(busy, 1000, 10, 2, 260_000) is None
    assert io_verdict(IOCounters(None, None, None), 1000, 10, 2) is None


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@needs_proc_io
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_random_reads_of_an_evicted_pack_read_about_the_records_only(tmp_path, fmt, small_memory):
    suffix, reader = FORMATS[fmt]
    path = tmp_path / f"big{suffix}"
    shape = (100, 120, 3)  # 36 KB records; 6 MB: several read-ahead windows
    _write(path, fmt, 170, shape)
    record = os.path.getsize(path) / 170
    _evict(path)
    probe = read_counters().read_bytes
    with open(path, "rb") as file:
        file.read(PAGE)
    if read_counters().read_bytes == probe:
        pytest.skip("this file system's reads do not show in /proc/self/io (tmpfs?)")
    dataset = reader(path, decode="numpy")  # opened (and closed) by the main process first
    _evict(path)
    order = np.random.default_rng(0).permutation(170)[:96].tolist()
    before = read_counters().read_bytes
    for start in range(0, 96, 32):
        dataset.__getitems__(order[start : start + 32])
    per_sample = (read_counters().read_bytes - before) / 96
    dataset.close()
    assert per_sample <= 1.5 * record + 2 * PAGE


# --- LMDB leaves parsed with NumPy ------------------------------------------------------------
def _spans_both_ways(file: bytes, monkeypatch, count: int) -> list:
    from fastloader.formats import lmdb_checks

    psize = 4096
    outcomes = []
    real = lmdb_checks._record_leaf
    for parse in (real, lambda page: None):  # NumPy, then node by node
        monkeypatch.setattr(lmdb_checks, "_record_leaf", parse)
        spans = lmdb_checks.RecordSpans(file, psize, _ROOT[0], count)
        seen = []
        for index in range(count):
            try:
                seen.append(spans.span(index))
            except lmdb_checks.LeafDamaged:
                seen.append("damaged")
        outcomes.append((seen, spans._spans.copy()))
    return outcomes


_ROOT = [0]


def test_numpy_leaf_parsing_decides_as_node_by_node(tmp_path, monkeypatch):
    from fastloader.formats.lmdb_checks import check_lmdb_file

    path = tmp_path / "small.lmdb"
    with open_writer(path, "lmdb", store="raw", classes=["a", "b"]) as writer:
        for index in range(1500):
            pixels = np.full((2, 5, 3), index % 256, np.uint8)
            writer.append(encode_record(pixels, index % 2, RecordKind.RAW), index % 2)
    data = path.read_bytes()
    psize, _ROOT[0] = check_lmdb_file(path, len(data))
    assert psize == 4096
    fast, slow = _spans_both_ways(data, monkeypatch, 1500)
    assert fast[0] == slow[0] and np.array_equal(fast[1], slow[1])
    pristine = fast[0]
    assert all(isinstance(span, tuple) for span in fast[0])
    leaves = [p for p in range(2, len(data) // psize) if data[p * psize + 10] & 0x02]
    rng = np.random.default_rng(0)
    changed = 0
    for trial in range(40):  # damaged leaves: the same records refused, the same spans kept
        damaged = bytearray(data)
        page = int(rng.choice(leaves))
        for _ in range(int(rng.integers(1, 4))):  # node offsets and headers, or anywhere
            at = page * psize + int(rng.integers(10, 300 if trial % 2 else psize))
            damaged[at] = int(rng.integers(0, 256))
        fast, slow = _spans_both_ways(bytes(damaged), monkeypatch, 1500)
        assert fast[0] == slow[0] and np.array_equal(fast[1], slow[1])
        changed += fast[0] != pristine
    assert changed >= 10  # the damage reached what is checked


def test_a_pack_written_in_a_seeded_shuffled_order_holds_every_image_once(tmp_path):
    """pack(shuffle_seed=) writes records in a seeded random order (for block shuffles): every
    file once, each record still naming its file and label, the same order for the same seed."""
    from PIL import Image

    import fastloader

    source = tmp_path / "src"
    for label, name in enumerate(["a", "b", "c"]):
        (source / name).mkdir(parents=True)
        for index in range(6):
            color = (40 * index, 80 * label, 7)
            Image.new("RGB", (8, 6), color).save(source / name / f"{index}.png")
    orders = []
    for run, seed in enumerate([5, 5, 6]):
        path = tmp_path / f"p{run}.lmdb"
        fastloader.pack(source, path, store="raw", shuffle_seed=seed, workers=0, progress=False)
        dataset = fastloader.LMDBDataset(path, decode="numpy")
        order = []
        for i in range(len(dataset)):
            pixels, label = dataset[i]
            relative = dataset.source_path(i)
            assert label == ["a", "b", "c"].index(relative.split("/")[0])
            expected = np.asarray(Image.open(source / relative).convert("RGB"))
            np.testing.assert_array_equal(pixels, expected)
            order.append(relative)
        orders.append(order)
    assert sorted(orders[0]) == sorted(f"{c}/{i}.png" for c in "abc" for i in range(6))
    assert orders[0] == orders[1] != orders[2]
    assert orders[0] != sorted(orders[0])
