"""Batches from workers through shared-memory slots: the same batches, safe to keep, and nothing
left behind after any death. See NOTE [ Batch transport ] in fastloader/loader/transport/.

Scenarios that kill processes run in their own process with a time limit, so a hang is seen as
a failure, not a stuck suite.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from torch.utils.data import Dataset

import fastloader
from fastloader.loader.transport import receive
from fastloader.loader.transport.slots import ROWS
from tests._batches import assert_same_batch

ROOT = Path(__file__).resolve().parents[1]
Point = collections.namedtuple("Point", "x y")


class Mixed(Dataset):
    """Every kind of leaf a batch has: tensors, arrays, numbers, strings, bytes, nesting."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> dict:
        return {
            "image": torch.full((3, 5, 4), index, dtype=torch.uint8),
            "float": torch.arange(3, dtype=torch.float64) + index,
            "array": np.arange(6, dtype=np.int16).reshape(2, 3) * index,
            "label": index,
            "weight": index / 2,
            "name": f"sample-{index}",
            "raw": bytes([index]),
            "nested": {"words": [f"w{index}", "x"], "point": Point(index, -index)},
            "flag": torch.tensor(index % 2 == 0),
            "empty": torch.zeros(0, 2),
        }


@pytest.mark.parametrize("collate", ["default", "identity", "none"])
def test_batches_from_workers_equal_the_batches_loaded_in_process(collate):
    kwargs: dict = {"batch_size": 4}
    if collate == "identity":
        kwargs["collate_fn"] = lambda samples: [
            {"image": s["image"], "array": s["array"], "name": s["name"]} for s in samples
        ]
    elif collate == "none":
        kwargs["batch_size"] = None
    expected = list(fastloader.DataLoader(Mixed(), num_workers=0, seed=0, **kwargs))
    loader = fastloader.DataLoader(Mixed(), num_workers=2, seed=0, **kwargs)
    for _ in range(2):
        got = list(loader)
        assert len(got) == len(expected)
        for ours, theirs in zip(got, expected, strict=True):
            assert_same_batch(ours, theirs)
    loader.close()


class Big(Dataset):
    def __init__(self, n: int = 3 * ROWS) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, np.ndarray]:
        return torch.full((1000,), index, dtype=torch.int32), np.full(7, index, np.float32)


def test_kept_batches_keep_their_values_while_more_arrive():
    # more batches kept than a worker has slots: none is overwritten (the rest travel pickled)
    loader = fastloader.DataLoader(Big(), batch_size=1, num_workers=1, seed=0)
    first = list(loader)
    second = list(loader)
    for epoch in (first, second):
        for index, (tensor, array) in enumerate(epoch):
            assert bool((tensor == index).all()) and bool((array == index).all()), index
    loader.close()


def test_a_batch_kept_after_the_loader_is_closed_is_still_valid():
    loader = fastloader.DataLoader(Big(8), batch_size=4, num_workers=2, seed=0)
    batches = list(loader)
    loader.close()
    del loader
    for number, (tensor, _) in enumerate(batches):
        assert tensor[:, 0].tolist() == list(range(4 * number, 4 * number + 4))
    batches[0][0] += 1  # the user's memory: writable
    assert int(batches[0][0][0, 0]) == 1


def _sum_in_child(queue, results) -> None:
    tensor = queue.get()
    results.put(int(tensor.sum()))


def test_a_batch_sent_to_another_process_arrives_whole():
    loader = fastloader.DataLoader(Big(8), batch_size=4, num_workers=1, seed=0)
    context = tmp.get_context("spawn")
    queue, results = context.Queue(), context.Queue()
    child = context.Process(target=_sum_in_child, args=(queue, results))
    child.start()
    tensor, _ = next(iter(loader))
    queue.put(tensor)
    assert results.get(timeout=60) == int(tensor.sum()) == 1000 * (0 + 1 + 2 + 3)
    child.join(timeout=30)
    loader.close()


def test_shared_memory_in_use_stays_within_prefetch_depth_times_batch_bytes():
    loader = fastloader.DataLoader(Big(200), batch_size=4, num_workers=2, seed=0)
    for _ in range(2):
        for _batch in loader:
            pass
    pool = loader._iterator
    files = receive.slot_files(pool._slot_key)
    batch_bytes = 4 * (1000 * 4 + 7 * 4)
    assert pool._batch_depth == 8  # 16 KB batches: NOTE [ Prefetch depth by batch bytes ]
    # NOTE [ Batches per message ]: messages of `group` batches, `messages` in flight
    group, messages = pool._groups.size, pool._prefetch_factor
    assert messages == (8 if group == 1 else max(2, -(-8 // group)))
    bound = (messages + 3) * group * batch_bytes * 1.25 + 4096 * 2  # pages, growth
    for slots in files:
        assert 0 < slots.bytes_in_use() <= bound, (slots.bytes_in_use(), bound)
    loader.close()


class Ragged(Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(50 * (index + 1), index, np.int64)


def test_batches_that_grow_get_bigger_slots():
    loader = fastloader.DataLoader(
        Ragged(), batch_size=3, num_workers=1, collate_fn=list, seed=0, shuffle=False
    )
    for number, batch in enumerate(loader):
        for offset, array in enumerate(batch):
            index = 3 * number + offset
            assert array.shape == (50 * (index + 1),) and bool((array == index).all())
    loader.close()


def _run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


_TORN_SLOT = """
    import os, signal, sys, warnings
    import torch
    from torch.utils.data import Dataset
    import fastloader
    from fastloader.loader.transport import send

    MARKER = sys.argv[1]


    def die_halfway_through_the_next_slot_write():
        if os.path.exists(MARKER):
            return
        open(MARKER, "w").close()
        write = send._write

        def torn_write(region, leaves, layout):
            memoryview(region)[: len(region) // 2] = b"\\xff" * (len(region) // 2)  # garbage
            os.kill(os.getpid(), signal.SIGKILL)

        send._write = torn_write


    class Images(Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, index):
            if index == 9:
                die_halfway_through_the_next_slot_write()
            return torch.full((3, 64, 64), index, dtype=torch.uint8)


    loader = fastloader.DataLoader(Images(), batch_size=4, num_workers=2, seed=0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for epoch in range(2):
            got = [batch[:, 0, 0, 0].tolist() for batch in loader]
            assert got == [list(range(i, i + 4)) for i in range(0, 24, 4)], got
    print("WHOLE EPOCHS")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL mid-write, Linux")
def test_a_worker_killed_while_writing_a_slot_never_delivers_half_a_batch(tmp_path):
    run = _run(_TORN_SLOT, str(tmp_path / "marker"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WHOLE EPOCHS" in run.stdout
    assert (tmp_path / "marker").exists()  # the worker really died mid-write


_KILLED = """
    import os, signal, sys, time
    import torch
    from torch.utils.data import Dataset
    import fastloader

    WHO = sys.argv[1]


    class Images(Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, index):
            return torch.full((3, 224, 224), index % 256, dtype=torch.uint8)


    loader = fastloader.DataLoader(Images(), batch_size=64, num_workers=2, seed=0)
    for step, batch in enumerate(loader):
        if step == 0:
            print("PIDS", os.getpid(), *loader._iterator.worker_pids, flush=True)
        if step == 3:
            if WHO == "main":
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(loader._iterator.worker_pids[0], signal.SIGKILL)
        if step == 12:
            break
    print("DONE", flush=True)
"""


def _our_names(before: set[str], pids: list[str]) -> list[str]:
    # other processes on this machine may make and remove files in /dev/shm meanwhile: only
    # names that are new and carry one of this scenario's process ids, or ours, count
    after = set(os.listdir("/dev/shm"))
    return [
        name
        for name in after - before
        if "fastloader" in name or any(f"_{pid}_" in name or name.endswith(pid) for pid in pids)
    ]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
@pytest.mark.parametrize("who", ["main", "worker"])
def test_nothing_is_left_in_dev_shm_after_sigkill(who):
    before = set(os.listdir("/dev/shm"))
    run = _run(_KILLED, who)
    pids = next(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("PIDS"))
    if who == "main":
        assert run.returncode == -9, run.stderr[-3000:]
        _wait_gone([int(pid) for pid in pids])
    else:
        assert run.returncode == 0 and "DONE" in run.stdout, run.stderr[-3000:]
    assert _our_names(before, pids) == []


def _wait_gone(pids: list[int], seconds: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        if not alive:
            return
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_dropping_its_copy_of_a_batch_leaves_the_parents_slot_alone():
    from fastloader.loader.transport.slots import READY

    loader = fastloader.DataLoader(Big(8), batch_size=4, num_workers=1, seed=0, in_order=False)
    batches = list(loader)  # no prefetch into the next epoch (in_order=False): rows stay put
    (slots,) = receive.slot_files(loader._iterator._slot_key)
    held = int((slots.table[:, 0] == READY).sum())
    assert held == 2
    pid = os.fork()
    if pid == 0:  # the child's copies die: the parent's batches must stay valid
        batches.clear()
        import gc

        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    assert int((slots.table[:, 0] == READY).sum()) == held
    assert [b[0][:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    loader.close()


def test_stacking_into_a_batch_refuses_what_np_stack_refuses():
    from fastloader.datasets.collate import stack_arrays

    rows = [np.arange(6.0).reshape(2, 3) + i for i in range(4)]
    out = np.empty((4, 2, 3))
    stack_arrays(rows, out)
    assert np.array_equal(out, np.stack(rows))
    # same total size, other shapes: concatenating would fill `out` silently wrong
    with pytest.raises(ValueError):
        stack_arrays([np.zeros((1, 3)), np.zeros((3, 3))], np.empty((2, 2, 3)))
    with pytest.raises(TypeError):
        stack_arrays([np.zeros(3, np.int64)] * 2, np.empty((2, 3), np.int32))
    scalars = [np.array(1.5), np.array(2.5)]
    stack_arrays(scalars, scalars_out := np.empty(2))
    assert scalars_out.tolist() == [1.5, 2.5]


def test_a_small_batch_takes_the_smallest_free_region_not_the_next_big_one():
    # rows are tried in turn first (the steady state), but only on a tight fit: a small batch
    # taking a big free region would make the next big batch grow another (twice the memory
    # with ragged batches)
    from fastloader.loader.transport import slots

    file = slots.SlotFile.create()
    try:
        big = slots.acquire(file, 10_000_000)
        small = slots.acquire(file, 1_000_000)
        file.free(big)
        file.free(small)
        assert file.hint == big  # the row after the last one taken wraps to the big one
        assert slots.acquire(file, 1_000_000) == small
        assert slots.acquire(file, 10_000_000) == big  # and the big batch still has its own
        file.free(big)
        file.free(small)
        before = file.bytes_in_use()
        for size in [1_000_000, 10_000_000] * 20:  # ragged, freed in order
            row = slots.acquire(file, size)
            file.free(row)
        assert file.bytes_in_use() == before
    finally:
        file.close()
