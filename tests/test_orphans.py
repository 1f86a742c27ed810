"""Workers never outlive the main process: SIGKILL it mid-epoch, under every start method,
iterating from the main thread or from another one while the workers hold the GIL, and no
worker, watcher or fork server is left (checked in /proc)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_DATASET = textwrap.dedent(
    """
    import ctypes

    import torch
    from torch.utils.data import Dataset


    class HoldsTheGil(Dataset):
        '''Sample i >= 8 never returns and never lets another thread of its process run: a C
        call through PyDLL keeps the GIL (as a long C extension call that does not release it).'''

        def __len__(self):
            return 64

        def __getitem__(self, index):
            if index >= 8:
                ctypes.PyDLL(None).sleep(1000)
            return torch.tensor([index])
    """
)

_MAIN = textwrap.dedent(
    """
    import sys
    import threading

    sys.path.insert(0, sys.argv[3])
    from fastloader import DataLoader
    from orphans_dataset import HoldsTheGil


    def run(method):
        loader = DataLoader(
            HoldsTheGil(), batch_size=2, num_workers=2, multiprocessing_context=method
        )
        batches = iter(loader)
        next(batches)
        print("ready", flush=True)
        for _ in batches:
            pass


    if __name__ == "__main__":
        method, where = sys.argv[1], sys.argv[2]
        if where == "thread":
            thread = threading.Thread(target=run, args=(method,))
            thread.start()
            thread.join()
        else:
            run(method)
    """
)


def _parents() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    return children


def _descendants(pid: int) -> list[int]:
    children, found, todo = _parents(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("where", ["main-thread", "thread"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_no_worker_outlives_a_sigkilled_main_process(tmp_path: Path, method, where):
    (tmp_path / "orphans_dataset.py").write_text(_DATASET)
    (tmp_path / "main.py").write_text(_MAIN)
    main = subprocess.Popen(
        [sys.executable, str(tmp_path / "main.py"), method, where, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # a stray process can be found and cleaned up
    )
    left = []
    try:
        assert main.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the workers are inside __getitem__ holding the GIL
        processes = _descendants(main.pid)
        assert len(processes) >= 2  # the workers (and for forkserver its server)
        os.kill(main.pid, signal.SIGKILL)
        main.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = [pid for pid in processes if _running(pid)]
            if not left:
                break
            time.sleep(0.1)
        assert left == [], f"still running after 10 s: {left}"
    finally:
        for pid in [main.pid, *left]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_COLLECTED_IN_A_FORK = textwrap.dedent(
    """
    import gc, os, sys
    from fastloader import DataLoader

    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=False)
    batches = iter(loader)
    next(batches)
    loader.close()
    pid = os.fork()
    if pid == 0:  # the child holds a copy of the iterator; collecting it must do nothing
        del batches
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    """
)


@pytest.mark.slow
def test_an_iterator_collected_in_a_forked_child_prints_nothing():
    process = subprocess.run(
        [sys.executable, "-c", _COLLECTED_IN_A_FORK], capture_output=True, text=True, timeout=60
    )
    assert process.returncode == 0
    assert process.stderr == ""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_training_process_leaves_no_stack_folder(tmp_path: Path, stop):
    """NOTE [ Worker stacks on timeout ]: the workers' stack files live in memory, so a main
    process stopped without running its finalizers leaves nothing in the temp folder."""
    (tmp_path / "orphans_dataset.py").write_text(_DATASET)
    (tmp_path / "main.py").write_text(_MAIN)
    temp = tmp_path / "tmp"
    temp.mkdir()
    main = subprocess.Popen(
        [sys.executable, str(tmp_path / "main.py"), "fork", "main-thread", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    try:
        assert main.stdout.readline().strip() == "ready"  # workers started and loading
        workers = _descendants(main.pid)
        os.kill(main.pid, stop)
        main.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(pid) for pid in workers):
            time.sleep(0.1)
    finally:
        if main.poll() is None:
            os.killpg(main.pid, signal.SIGKILL)
            main.wait()
    assert [name for name in os.listdir(temp) if name.startswith("fastloader")] == []
