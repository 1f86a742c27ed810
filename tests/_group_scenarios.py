"""Scenarios of tests/test_batch_groups.py that kill workers, each run in its own process.

Batches travel in groups of ``MAX_GROUP`` from the ``DECIDE_AT``-th batch of the first epoch
on (NOTE [ Batches per message ]): ``MESSAGE_S`` is raised so the decision does not depend on
this machine's speed. Prints one JSON line.
"""

import json
import os
import signal
import sys
import warnings

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _supervision_scenarios import results_of_epoch  # noqa: E402

from fastloader import DataLoader  # noqa: E402
from fastloader.loader.transport import groups  # noqa: E402

groups.MESSAGE_S = 10.0


class Indices(Dataset):
    """Sample i is i; the samples in ``poison`` kill the worker that loads them, every time."""

    def __init__(self, length, poison=()):
        self.length = length
        self.poison = set(poison)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if i in self.poison and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def killed():
    """A worker killed while groups are in flight: the epochs equal a clean run's."""
    loader = DataLoader(Indices(800), batch_size=4, num_workers=2, shuffle=True, seed=3)
    clean = DataLoader(Indices(800), batch_size=4, num_workers=0, shuffle=True, seed=3)

    def kill_at_100(delivered):
        if delivered == 100:
            report["size_before"] = loader._iterator._groups.size
            os.kill(loader.worker_pids[0], signal.SIGKILL)

    report = {}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        epochs = [
            results_of_epoch(loader, kill_at_100 if epoch == 0 else None) for epoch in range(2)
        ]
    report["size_after"] = loader._iterator._groups.size
    report["equal"] = epochs == [results_of_epoch(clean) for _ in range(2)]
    report["deaths_warned"] = sum("SIGKILL" in str(w.message) for w in warned)
    loader.close()
    print(json.dumps(report), flush=True)


def poisoned():
    """A sample that kills its worker every time, inside a group and then without groups."""
    loader = DataLoader(Indices(400, poison=[300]), batch_size=2, num_workers=2, seed=0)
    report = {}

    def size_at_100(delivered):
        if delivered == 100:  # batch 150 (samples 300-301) is sent in a group after this
            report["size_before"] = loader._iterator._groups.size

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report["epochs"] = [results_of_epoch(loader, size_at_100), results_of_epoch(loader)]
    loader.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
