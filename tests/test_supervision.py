"""Supervised workers: deaths healed with identical batches, poison samples, no orphans, stalls.

Every scenario runs in its own process (tests/_supervision_scenarios.py), bounded in time.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from _signals import sigint_default

SCENARIOS = os.path.join(os.path.dirname(__file__), "_supervision_scenarios.py")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")


def _run(name: str, timeout: float = 120) -> dict:
    result = subprocess.run(
        [sys.executable, SCENARIOS, name], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _in_own_session(name: str, stderr: int) -> Iterator[subprocess.Popen]:
    """A scenario in its own session (signals go to its group); its group killed if still up."""
    child = subprocess.Popen(
        [sys.executable, SCENARIOS, name],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,  # the signals a test sends reach this group only
        preexec_fn=sigint_default,  # Ctrl-C reaches it under `nohup` or `&` too
    )
    try:
        yield child
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_killed_workers_are_replaced_and_every_epoch_equals_a_clean_run():
    report = _run("kills")
    assert report["equal"] == {"one": True, "all": True, "between": True, "out_of_order": True}
    assert report["pids_after_kill"]["one"] is False  # worker_pids lists live workers only
    assert all(report["live_after_heal"].values())
    warned = report["deaths_warned"]
    assert [len(warned[k]) for k in ("one", "all", "between")] == [1, 2, 1]  # one per death
    assert all("SIGKILL" in w and "likely the OOM killer" in w for k in warned for w in warned[k])
    assert all("pid" in w for k in warned for w in warned[k])


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_raises_in_the_loop_and_next_epoch_has_fresh_workers():
    with _in_own_session("interrupted", stderr=subprocess.PIPE) as child:
        assert child.stdout.readline().strip() == "READY"
        os.killpg(child.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"equal": True, "interrupts": 1, "fresh_workers": True, "workers": 2}


def test_a_sample_that_kills_its_worker_three_times_raises_naming_epoch_and_indices():
    epochs = _run("poison")["epochs"]
    for epoch, results in enumerate(epochs):
        assert len(results) == 8  # never a short epoch: the poisoned batch is an error
        assert results[:2] == [[0, 1], [2, 3]] and results[3:] == [
            [6, 7],
            [8, 9],
            [10, 11],
            [12, 13],
            [14, 15],
        ]
        error = results[2]
        assert error.startswith("PoisonSampleError")
        assert "[4, 5]" in error and f"epoch {epoch}" in error and "3 times" in error
        assert "DataLoader worker (pid" in error and "is killed by signal: Killed" in error


@pytest.mark.slow
def test_workers_that_cannot_be_restored_make_every_epoch_raise():
    outcomes = _run("unrestorable")["outcomes"]
    assert outcomes[0] == 8
    assert len(outcomes) == 3
    for outcome in outcomes[1:]:
        assert isinstance(outcome, str) and outcome.startswith("WorkersLostError"), outcome
        assert "cannot be restored" in outcome


def _expected(poison, batch_size, length=24):
    """Each batch: its indices, or "poison" where one of its samples kills its worker."""
    batches = [list(range(i, min(i + batch_size, length))) for i in range(0, length, batch_size)]
    return [("poison" if set(b) & set(poison) else b) for b in batches]


@pytest.mark.slow
def test_poison_batches_one_after_another_each_raise_and_the_epoch_goes_on():
    # Each poison verdict settles its task: it is progress, not a worker that cannot be
    # restored (that used to raise WorkersLostError, or wait forever for the next result).
    report = _run("consecutive_poison", timeout=180)
    cases = {"one_worker": ([5, 6, 7], 1), "two_workers": (range(4, 16), 2)}
    for name, (poison, batch_size) in cases.items():
        for epoch, results in enumerate(report[name]):
            expected = _expected(poison, batch_size)
            assert len(results) == len(expected), (name, epoch, results)
            for want, got in zip(expected, results, strict=True):
                if want == "poison":
                    assert isinstance(got, str) and got.startswith("PoisonSampleError"), got
                    assert f"epoch {epoch}" in got
                else:
                    assert got == want, (name, epoch, results)


def test_after_workers_are_lost_every_remaining_batch_of_the_epoch_raises():
    # A loop that catches errors per batch and goes on sees len(loader) results, never a
    # short epoch; the next epoch starts a fresh pool (and raises again while it cannot).
    report = _run("lost_continue")
    length = report["length"]
    lost, again, restored = report["epochs"]
    delivered = [r for r in lost if not isinstance(r, str)]
    assert len(delivered) >= 2 and delivered == [
        [i, i + 1] for i in range(0, 2 * len(delivered), 2)
    ]
    assert len(lost) == length and len(again) == length  # every batch: delivered or raised
    for outcome in lost[len(delivered) :] + again:
        assert isinstance(outcome, str) and outcome.startswith("WorkersLostError"), outcome
        assert "cannot be restored" in outcome
    assert restored == [[i, i + 1] for i in range(0, 16, 2)]


def test_workers_exit_soon_after_the_main_process_is_killed_inside_a_long_getitem():
    with _in_own_session("orphan", stderr=subprocess.DEVNULL) as child:
        pids = json.loads(child.stdout.readline())["pids"]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        child.kill()
        child.wait(timeout=30)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "workers outlived the main process"


@pytest.mark.slow
def test_timeout_names_the_stuck_worker_its_indices_and_shows_its_stack():
    report = _run("stalled")
    message = report["message"]
    assert message is not None and message.startswith("DataLoader timed out after 2 seconds")
    assert "worker 1 (pid" in message
    assert "it is loading indices [6, 7] (epoch 0)" in message
    assert "Python stack of worker 1" in message
    assert "in __getitem__" in message and "_supervision_scenarios.py" in message


def test_a_forked_worker_that_never_starts_is_replaced_and_the_epochs_are_unchanged(tmp_path):
    # NOTE [ Worker start-up ]: a fork that deadlocks before running Python used to hang the
    # loop forever (seen once in CI with workers forked from a DDP rank).
    os.environ["FASTLOADER_TEST_HANG_ONCE"] = str(tmp_path / "hung-once")
    try:
        report = _run("never_started")
    finally:
        del os.environ["FASTLOADER_TEST_HANG_ONCE"]
    assert report["equal"] is True
    assert report["live"] == 2
    assert len(report["warned"]) == 1
    assert "did not start within 1 s" in report["warned"][0]
    assert "killed and replaced" in report["warned"][0]
    assert report["seconds"] < 60


@pytest.mark.slow
def test_a_timeout_before_the_start_up_check_names_the_worker_that_never_started(tmp_path):
    os.environ["FASTLOADER_TEST_HANG_ONCE"] = str(tmp_path / "hung-once")
    try:
        message = _run("never_started_timeout")["message"]
    finally:
        del os.environ["FASTLOADER_TEST_HANG_ONCE"]
    assert "DataLoader timed out after 2 seconds" in message
    assert "it has not started: it never reached fastloader's start-up code" in message
