"""Scenarios for tests/test_supervision.py, each run as its own process: python this.py NAME.

Each prints one JSON line with what it saw; the test asserts on it. Workers are killed for
real (SIGKILL, SIGINT to the process group, a crash in dataset[i]), so a scenario that goes
wrong is seen as a crash or a timeout of the child process, not of the test runner.
"""

import json
import multiprocessing.context
import os
import signal
import sys
import time
import warnings

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _datasets import RandomDraws  # noqa: E402

from fastloader import DataLoader  # noqa: E402

EPOCHS = 3


class SlowDraws(RandomDraws):
    """RandomDraws without the pid, a little slow so that workers are busy when killed."""

    def __getitem__(self, i):
        time.sleep(0.005)
        return super().__getitem__(i)[0]


class KillsItsWorker(Dataset):
    """Sample 5 kills the process that loads it (a segfault in a C extension, say)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class Hangs(Dataset):
    """Sample 6 never finishes."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 6:
            time.sleep(600)
        return i


def _loader(**kwargs):
    options = dict(batch_size=4, shuffle=True, num_workers=2, seed=11)
    options.update(kwargs)
    return DataLoader(SlowDraws(48), **options)


def _epochs(loader, hook=None):
    epochs = []
    for epoch in range(EPOCHS):
        batches = []
        for step, batch in enumerate(loader):
            batches.append(batch.tolist())
            if hook is not None:
                hook(loader, epoch, step)
        epochs.append(batches)
    return epochs


def kills():
    """Kill one worker / all workers mid-epoch, and one between epochs; compare to clean."""
    reference = _epochs(_loader())
    report = {"deaths_warned": {}, "equal": {}, "pids_after_kill": {}, "live_after_heal": {}}

    def kill_one(loader, epoch, step):
        if (epoch, step) == (1, 3):
            pid = loader.worker_pids[0]
            os.kill(pid, signal.SIGKILL)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            report["pids_after_kill"]["one"] = pid in loader.worker_pids

    def kill_all(loader, epoch, step):
        if (epoch, step) == (1, 3):
            for pid in loader.worker_pids:
                os.kill(pid, signal.SIGKILL)

    def kill_between(loader, epoch, step):
        if (epoch, step) == (0, 11):  # the last batch of epoch 0
            os.kill(loader.worker_pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 1.0
            total = 0
            while time.monotonic() < deadline:  # user code runs while the worker is dead
                total += sum(range(1000))

    cases = (
        ("one", kill_one, {}),
        ("all", kill_all, {}),
        ("between", kill_between, {}),
        ("out_of_order", kill_one, {"in_order": False}),
    )
    for name, hook, options in cases:
        loader = _loader(**options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            epochs = _epochs(loader, hook)
            if options:  # batches arrive in any order: compare each epoch's set of batches
                report["equal"][name] = [sorted(e) for e in epochs] == [
                    sorted(e) for e in reference
                ]
            else:
                report["equal"][name] = epochs == reference
        report["deaths_warned"][name] = [
            str(w.message) for w in caught if "DataLoader worker" in str(w.message)
        ]
        pids = loader.worker_pids
        report["live_after_heal"][name] = len(pids) == 2 and all(_alive(p) for p in pids)
        loader.close()
    print(json.dumps(report), flush=True)


def interrupted():
    """Wait for SIGINT to the whole process group during epoch 1, then finish the epochs."""
    reference = _epochs(_loader(num_workers=0))
    loader = _loader()
    got, interrupts = [], 0
    epoch = 0
    old_pids = None
    while epoch < EPOCHS:
        batches = []
        try:
            for step, batch in enumerate(loader):
                batches.append(batch.tolist())
                if epoch == 1 and step == 2 and interrupts == 0:
                    old_pids = loader.worker_pids
                    print("READY", flush=True)
                    time.sleep(30)  # the test sends SIGINT to the process group now
        except KeyboardInterrupt:
            interrupts += 1
            loader.set_epoch(epoch)  # run the interrupted epoch again
            continue
        got.append(batches)
        epoch += 1
    new_pids = loader.worker_pids
    report = {
        "equal": got == reference,
        "interrupts": interrupts,
        "fresh_workers": bool(old_pids) and not set(old_pids) & set(new_pids),
        "workers": len(new_pids),
    }
    loader.close()
    print(json.dumps(report), flush=True)


def poison():
    """A sample that kills its worker every time: an error naming epoch and indices."""
    loader = DataLoader(KillsItsWorker(), batch_size=2, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epochs = [results_of_epoch(loader) for _ in range(2)]
    loader.close()
    print(json.dumps({"epochs": epochs}), flush=True)


def unrestorable():
    """Workers that die at start-up: every epoch raises, none is empty or short."""
    # more batches than the pool prefetches: batches already in shared-memory slots when the
    # workers are killed stay valid (NOTE [ Batch transport ]), the rest need new workers
    loader = DataLoader(
        range(16), batch_size=2, num_workers=2, prefetch_factor=2, worker_init_fn=_die_if_marked
    )
    outcomes = [len(list(loader))]
    os.environ["FASTLOADER_TEST_DIE"] = "1"  # replacements now die as they start
    for pid in loader.worker_pids:
        os.kill(pid, signal.SIGKILL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            try:
                outcomes.append(len(list(loader)))
            except RuntimeError as error:
                outcomes.append(f"{type(error).__name__}: {error}")
    loader.close()
    print(json.dumps({"outcomes": outcomes}), flush=True)


class KillsItsWorkerAt(Dataset):
    """Each sample in ``poison`` kills the process that loads it, every time."""

    def __init__(self, poison):
        self.poison = set(poison)

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i in self.poison and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def results_of_epoch(loader, before_next=None):
    """Every result of one epoch, going on after errors as the README suggests.
    ``before_next(count)`` runs before each ``next`` (count: results so far)."""
    results = []
    iterator = iter(loader)
    while len(results) < 3 * len(loader):  # bounded even if an epoch never ends
        if before_next is not None:
            before_next(len(results))
        try:
            results.append(next(iterator).tolist())
        except StopIteration:
            break
        except RuntimeError as error:
            results.append(f"{type(error).__name__}: {error}")
    return results


def consecutive_poison():
    """Poison batches one after another, on one worker and on two."""
    report = {}
    cases = (("one_worker", [5, 6, 7], 1, 1), ("two_workers", range(4, 16), 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, poison, workers, batch_size in cases:
            loader = DataLoader(
                KillsItsWorkerAt(poison), batch_size=batch_size, num_workers=workers
            )
            report[name] = [results_of_epoch(loader) for _ in range(2)]
            loader.close()
    print(json.dumps(report), flush=True)


def lost_continue():
    """Workers lost mid-epoch; the loop catches each error and goes on: never a short epoch."""
    loader = DataLoader(
        range(16), batch_size=2, num_workers=2, prefetch_factor=2, worker_init_fn=_die_if_marked
    )

    def kill_the_workers_after_two(count):
        if count == 2:
            os.environ["FASTLOADER_TEST_DIE"] = "1"  # replacements now die as they start
            for pid in loader.worker_pids:
                os.kill(pid, signal.SIGKILL)

    epochs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epochs.append(results_of_epoch(loader, kill_the_workers_after_two))
        epochs.append(results_of_epoch(loader))  # a fresh pool, whose workers die too
        os.environ["FASTLOADER_TEST_DIE"] = "0"
        epochs.append(results_of_epoch(loader))  # workers can be restored again
    loader.close()
    print(json.dumps({"epochs": epochs, "length": len(loader)}), flush=True)


def _die_if_marked(worker_id):
    if os.environ.get("FASTLOADER_TEST_DIE") == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def orphan():
    """Print the worker pids while they are inside a long dataset[i]; the test kills us."""
    loader = DataLoader(Hangs(), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    time.sleep(0.5)  # worker 1 is now inside dataset[6]
    print(json.dumps({"pids": loader.worker_pids}), flush=True)
    time.sleep(600)


def stalled():
    """timeout fires while a worker is stuck: the error names it, its indices, its stack."""
    loader = DataLoader(Hangs(), batch_size=2, num_workers=2, timeout=2)
    try:
        list(loader)
        message = None
    except RuntimeError as error:
        message = str(error)
    pids = loader.worker_pids
    loader.close()
    print(json.dumps({"message": message, "pids": pids}), flush=True)


class _HangsBeforePython(multiprocessing.context.ForkProcess):
    """A forked worker that, the first time only, hangs before running any of torch's or
    fastloader's code: what a fork that inherited a held lock does."""

    def run(self):
        try:
            os.close(os.open(os.environ["FASTLOADER_TEST_HANG_ONCE"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().run()
        time.sleep(600)


class _HangOnceContext(multiprocessing.context.ForkContext):
    Process = _HangsBeforePython


def never_started():
    """One worker never starts: it is replaced after STARTUP_TIMEOUT_S; epochs equal clean."""
    from fastloader.loader import supervision as _supervision

    _supervision.STARTUP_TIMEOUT_S = 1.0
    reference = _epochs(_loader())
    loader = _loader(multiprocessing_context=_HangOnceContext())
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = _epochs(loader)
    report = {
        "equal": epochs == reference,
        "seconds": time.monotonic() - started,
        "warned": [str(w.message) for w in caught if "DataLoader worker" in str(w.message)],
        "live": len(loader.worker_pids),
    }
    loader.close()
    print(json.dumps(report), flush=True)


def never_started_timeout():
    """timeout (2 s) fires before the start-up check (60 s): its error names the worker."""
    loader = _loader(multiprocessing_context=_HangOnceContext(), timeout=2)
    try:
        _epochs(loader)
        message = ""
    except RuntimeError as error:
        message = str(error)
    loader.close()
    print(json.dumps({"message": message}), flush=True)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    globals()[sys.argv[1]]()
