"""A batch stays stable while another process holds it; groups of batches stay within their
bytes whatever the batches become; ``timeout=`` is the wait for one batch; a worker that dies
between a batch's commit and its descriptor leaves no row behind (issue 39).

See NOTE [ Batch transport ] in fastloader/loader/transport/ and NOTE [ Batches per message ]
in its groups.py. Scenarios that fork, kill or wait run in their own process with a time limit
(tests/_transport_round4_scenarios.py).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import Dataset

from fastloader import DataLoader
from fastloader.loader.transport import groups, receive, slots

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = Path(__file__).with_name("_transport_round4_scenarios.py")


def _scenario(name: str, *args: str, timeout: float = 240) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(SCENARIOS), name, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("how", ["args", "inherited", "queue-fork"])
def test_a_batch_a_forked_child_holds_keeps_its_values_while_the_parent_goes_on(how):
    # the case: the parent drops the batch and iterates 200 more; the child's [0..3]
    # must not become [216..219]. Batch 0 travels alone, batch 300 in a group of 16.
    report = _scenario("child_holds", how)
    assert report["group_size"] == groups.MAX_GROUP
    for at in ("0", "300"):
        held = report[at]
        assert held["before"] == held["after"] == held["expected"], (at, held)


def test_a_batch_put_on_a_queue_to_a_spawned_child_keeps_its_values():
    report = _scenario("child_holds", "queue-spawn")
    for at in ("0", "300"):
        held = report[at]
        assert held["before"] == held["after"] == held["expected"], (at, held)


class Growing(Dataset):
    """Batches of 4 whose samples grow from 1 KB to 3.6 MB a batch over the epoch (a
    curriculum): the first batches are the smallest."""

    def __len__(self) -> int:
        return 1600

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(256 + (index // 4) * 640, index % 100, np.int32)


def _region_bytes(pool, batch) -> int:
    # the bytes of the slot region a batch came in (all the batches of its group)
    pointer = batch.data_ptr()
    for file in receive.slot_files(pool._slot_key):
        for address, size in file.live.values():
            if address <= pointer < address + size:
                return size
    raise AssertionError("a batch outside every slot region")


def test_groups_of_growing_batches_stay_within_their_bytes(monkeypatch):
    monkeypatch.setattr(groups, "MESSAGE_S", 10.0)  # groups of 16 from the 48th batch on
    loader = DataLoader(Growing(), batch_size=4, num_workers=2, seed=0)
    largest_region = largest_file = messages = 0
    sizes = set()
    for number, batch in enumerate(loader):
        assert int(batch[0, 0]) == (4 * number) % 100
        pool = loader._iterator
        sizes.add(pool._groups.size)
        messages = max(messages, pool._prefetch_factor)
        largest_region = max(largest_region, _region_bytes(pool, batch))
        files = receive.slot_files(pool._slot_key)
        largest_file = max(largest_file, *(file.bytes_in_use() for file in files))
    assert groups.MAX_GROUP in sizes and min(sizes) < 4  # groups formed, then shrank
    # NOTE [ Batches per message ], "Memory": every region at most GROUP_BYTES of batches;
    # per worker, the messages in flight and three more regions, an eighth over to grow
    assert largest_region <= groups.GROUP_BYTES, largest_region
    bound = (messages + 3) * groups.GROUP_BYTES * 9 / 8
    assert largest_file <= bound, (largest_file, bound)
    loader.close()


def test_one_batch_per_message_growing_keeps_regions_for_the_batches_in_flight():
    # batches that grow hand their old regions back instead of leaving one of each size
    loader = DataLoader(Growing(), batch_size=4, num_workers=2, seed=0, prefetch_factor=4)
    regions = 0
    for _batch in loader:
        files = receive.slot_files(loader._iterator._slot_key)
        regions = max(regions, *(int((file.table[:, 2] > 0).sum()) for file in files))
    # 4 tasks in flight, the batch held, the one written, and rows in between
    assert regions <= 4 + 4, regions
    assert loader._iterator._groups.size == 1
    loader.close()


def test_a_grouped_run_whose_batches_each_beat_the_timeout_never_times_out():
    # 16 batches of 0.1 s a message, timeout=0.5: torch's timeout is per batch
    report = _scenario("timeout_grouped")
    assert report["max_size"] == groups.MAX_GROUP
    assert report["error"] is None and report["batches"] == 112, report


def test_a_batch_stuck_inside_a_group_raises_the_timeout_naming_its_indices():
    report = _scenario("timeout_stuck")
    assert report["error"] == "DataLoader timed out after 0.5 seconds", report
    assert report["loading_stuck_sample"], report.get("message")


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL of workers, Linux")
def test_workers_killed_between_commit_and_descriptor_leave_no_row_behind(tmp_path):
    # each death used to keep its READY row for the loader's life
    report = _scenario("unsent_rows", str(tmp_path))
    assert report["deaths"] == 24 and report["whole"], report
    assert report["ready"] == [0, 0], report  # nothing in flight: every row is free
    assert max(report["regions"]) <= 16, report  # memory bounded after the deaths


def test_a_descriptor_of_a_reclaimed_row_rebuilds_as_stale():
    file = slots.SlotFile.create()
    key = receive.register([file])
    try:
        row = slots.acquire(file, 64)
        file.table[row, 0] = slots.READY
        generation = int(file.table[row, 3])
        layout = pickle.dumps((("n", np.dtype(np.int64), (8,), 0, 64),))
        capacity = int(file.table[row, 2])
        skeleton = receive.Leaf(0)  # the batch is the one array
        args = (key, 0, row, int(file.table[row, 1]), capacity, generation, layout, skeleton)
        assert receive.reclaim_unsent(key, 0) == 1  # a dead worker's row no batch holds
        assert receive.rebuild(*args) is receive.STALE
        again = slots.acquire(file, 64)  # the row goes to the next batch, a new generation
        file.table[again, 0] = slots.READY
        assert again == row and receive.rebuild(*args) is receive.STALE
        args = (*args[:5], int(file.table[row, 3]), *args[6:])
        batch = receive.rebuild(*args)
        assert batch.shape == (8,)
        assert receive.reclaim_unsent(key, 0) == 0  # a row a batch holds is never reclaimed
        del batch
        assert file.table[row, 0] == slots.FREE
    finally:
        receive.unregister(key)


def test_a_group_grown_past_its_bytes_is_cut_into_regions_within_them():
    from fastloader.loader.transport.send import _cut

    mib = 1 << 20

    def cuts(sizes_mib):  # one leaf per batch, as ``_layout`` places them
        offsets = [sum(sizes_mib[:i]) * mib for i in range(len(sizes_mib))]
        layout = tuple(("n", None, (), offset, 0) for offset in offsets)
        return _cut(layout, sum(sizes_mib) * mib, list(range(1, len(sizes_mib) + 1)))

    assert groups.GROUP_BYTES == 8 * mib
    assert cuts([3, 3, 3]) == [2, 3]  # 6 MiB, then 3
    assert cuts([2, 2, 2, 2]) == [4]  # exactly the bound: one region
    assert cuts([10, 1, 1]) == [1, 3]  # a batch bigger than the bound goes alone
    assert cuts([1, 10, 1]) == [1, 2, 3]
