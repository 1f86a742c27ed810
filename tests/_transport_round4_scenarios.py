"""Scenarios of tests/test_transport_round4.py that fork, kill or wait, each run in its own
process: ``python _transport_round4_scenarios.py NAME [ARG]`` prints one JSON line.

Batches travel in groups of ``MAX_GROUP`` from the ``DECIDE_AT``-th batch of the first epoch
on (NOTE [ Batches per message ]): ``MESSAGE_S`` is raised so the decision does not depend on
this machine's speed.
"""

import json
import multiprocessing
import os
import signal
import sys
import time
import warnings

import torch
from torch.utils.data import Dataset

from fastloader import DataLoader
from fastloader.loader.transport import groups, receive
from fastloader.loader.transport.slots import READY

groups.MESSAGE_S = 10.0


class Rows(Dataset):
    """Sample i is a row of 256 copies of i."""

    def __len__(self):
        return 4000

    def __getitem__(self, i):
        return torch.full((256,), i, dtype=torch.int64)


def _report(child_values, queue):
    queue.put(child_values)


def _hold(batch, queue):
    # a child that holds a batch while the parent goes on: its values then, and later
    before = batch[:, 0].tolist()
    time.sleep(1.0)
    queue.put((before, batch[:, 0].tolist()))


_inherited = None


def _hold_inherited(queue):
    _hold(_inherited, queue)


def _hold_from_queue(batches, queue):
    _hold(batches.get(timeout=60), queue)


def child_holds(how):
    """The issue's case: a child process holds batch ``at`` while the parent drops it and
    iterates 200 more batches (groups of 16 from batch 48 on)."""
    global _inherited
    context = multiprocessing.get_context("spawn" if how == "queue-spawn" else "fork")
    loader = DataLoader(Rows(), batch_size=4, num_workers=2, seed=0)
    batches = iter(loader)
    report = {}
    for at in (0, 300):  # a batch sent alone, and one of a group
        while True:
            batch = next(batches)
            if int(batch[0, 0]) == 4 * at:
                break
        results = context.Queue()
        if how == "args":
            child = context.Process(target=_hold, args=(batch, results))
        elif how == "inherited":
            _inherited = batch
            child = context.Process(target=_hold_inherited, args=(results,))
        else:
            sent = context.Queue()
            child = context.Process(target=_hold_from_queue, args=(sent, results))
        child.start()
        if how.startswith("queue"):
            sent.put(batch)
        del batch
        _inherited = None
        for _ in range(200):
            next(batches)
        before, after = results.get(timeout=60)
        child.join(timeout=30)
        report[at] = {"before": before, "after": after, "expected": list(range(4 * at, 4 * at + 4))}
    report["group_size"] = loader._iterator._groups.size
    loader.close()
    print(json.dumps(report), flush=True)


class SlowBatches(Dataset):
    """Each batch of 4 after the first 48 takes about ``seconds``; sample ``stuck`` sleeps
    ``stuck_s``."""

    def __init__(self, seconds, stuck=-1, stuck_s=0.0):
        self.seconds = seconds
        self.stuck = stuck
        self.stuck_s = stuck_s

    def __len__(self):
        return 4 * 48 + 4 * 64

    def __getitem__(self, i):
        if i == self.stuck:
            time.sleep(self.stuck_s)
        elif i >= 4 * 48:
            time.sleep(self.seconds / 4)
        return i


def timeout_grouped():
    """Groups of 16 batches of 0.1 s each, ``timeout=0.5``: a message takes longer than the
    timeout, no batch does."""
    loader = DataLoader(SlowBatches(0.1), batch_size=4, num_workers=2, seed=0, timeout=0.5)
    report = {"batches": 0, "error": None, "sizes": []}
    try:
        for _ in loader:
            report["batches"] += 1
            report["sizes"].append(loader._iterator._groups.size)
    except RuntimeError as error:
        report["error"] = str(error).splitlines()[0]
    report["max_size"] = max(report.pop("sizes"))
    loader.close()
    print(json.dumps(report), flush=True)


def timeout_stuck():
    """A sample stuck for 60 s inside a group, ``timeout=0.5``: the timeout error."""
    dataset = SlowBatches(0.01, stuck=4 * 80 + 1, stuck_s=60.0)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, seed=0, timeout=0.5)
    report = {"batches": 0, "error": None}
    started = time.monotonic()
    try:
        for _ in loader:
            report["batches"] += 1
    except RuntimeError as error:
        report["error"] = str(error).splitlines()[0]
        report["loading_stuck_sample"] = f"indices [{4 * 80}, {4 * 80 + 1}" in str(error)
        report["message"] = str(error)[:1500]
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report), flush=True)
    os._exit(0)  # (the stuck worker sleeps on)


class Bomb:
    """Kills the worker that pickles it, once per marker file: after the batch's row is
    READY and before its descriptor is written (NOTE [ Batch transport ], the commit)."""

    def __init__(self, index, folder):
        self.index = index
        self.folder = folder

    def __reduce__(self):
        marker = os.path.join(self.folder, str(self.index))
        worker = torch.utils.data.get_worker_info() is not None
        if worker and self.index % 16 == 5 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return (Bomb, (self.index, self.folder))


class Bombs(Dataset):
    def __init__(self, folder, length):
        self.folder = folder
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return torch.full((64, 64), i, dtype=torch.int32), Bomb(i, self.folder)


def _collate(samples):
    return torch.stack([s[0] for s in samples]), [s[1] for s in samples]


def unsent_rows(folder):
    """Workers killed between a batch's commit and its descriptor, again and again: the rows
    they held come back."""
    length = 16 * 24
    # in_order=False: nothing is sent ahead into the next epoch, so no row is READY after it
    loader = DataLoader(
        Bombs(folder, length),
        batch_size=2,
        num_workers=2,
        seed=0,
        collate_fn=_collate,
        in_order=False,
    )
    report = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = sorted(batch[0][:, 0, 0].tolist() for batch in loader)
    report["deaths"] = len(os.listdir(folder))
    report["whole"] = first == [[i, i + 1] for i in range(0, length, 2)]
    files = receive.slot_files(loader._iterator._slot_key)
    report["ready"] = [int((slots.table[:, 0] == READY).sum()) for slots in files]
    report["regions"] = [int((slots.table[:, 2] > 0).sum()) for slots in files]
    loader.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    {
        "child_holds": child_holds,
        "timeout_grouped": timeout_grouped,
        "timeout_stuck": timeout_stuck,
        "unsent_rows": unsent_rows,
    }[sys.argv[1]](*sys.argv[2:])
