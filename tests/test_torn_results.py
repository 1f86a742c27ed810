"""A worker killed while writing a result through the pipe: no hang, the epoch is whole.

See NOTE [ Torn results ] in fastloader/loader/result_queue.py. Each scenario runs in its own
process with a time limit, so a hang is seen as a failure, not a stuck suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCENARIO = textwrap.dedent(
    """
    import os, signal, sys, warnings
    from multiprocessing.connection import Connection

    import torch
    from torch.utils.data import Dataset, IterableDataset, get_worker_info

    import fastloader

    MARKER = sys.argv[1]
    KIND = sys.argv[2]
    SIZE = 300_000  # bytes: travels through the pipe in many writes


    def payload(index):
        return bytes([index % 251]) * SIZE


    def die_halfway_through_the_next_big_write():
        if os.path.exists(MARKER):
            return
        open(MARKER, "w").close()
        send = Connection._send

        def torn_send(self, buf, *args):
            if len(buf) >= SIZE:
                send(self, bytes(memoryview(buf)[: len(buf) // 2]))
                os.kill(os.getpid(), signal.SIGKILL)
            return send(self, buf, *args)

        Connection._send = torn_send


    class Bytes(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, index):
            if index == 5:
                die_halfway_through_the_next_big_write()
            return payload(index)


    class Stream(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            for index in range(info.id, 12, info.num_workers):
                if index == 5:
                    die_halfway_through_the_next_big_write()
                yield payload(index)


    def collate(batch):
        return batch[0]


    if KIND == "map":
        loader = fastloader.DataLoader(
            Bytes(), batch_size=1, num_workers=2, collate_fn=collate, seed=0
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(loader)
        assert got == [payload(i) for i in range(12)], "an epoch with a torn result differs"
        deaths = [w for w in caught if "died" in str(w.message) or "killed" in str(w.message)]
        assert deaths, [str(w.message) for w in caught]
        print("WHOLE EPOCH")
    else:
        loader = fastloader.DataLoader(Stream(), batch_size=1, num_workers=2, collate_fn=collate)
        try:
            list(loader)
        except RuntimeError as error:
            print("RAISED", error)
    loader.close() if hasattr(loader, "close") else None
    """
)


def _run(tmp_path: Path, kind: str) -> subprocess.CompletedProcess:
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "marker"), kind],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the torn write is staged with Linux pipes")
def test_a_worker_killed_mid_message_is_replaced_and_the_epoch_is_whole(tmp_path):
    run = _run(tmp_path, "map")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WHOLE EPOCH" in run.stdout
    assert (tmp_path / "marker").exists()  # the worker really died mid-message


@pytest.mark.skipif(sys.platform != "linux", reason="the torn write is staged with Linux pipes")
def test_an_unsupervised_pool_raises_torchs_error_instead_of_hanging(tmp_path):
    run = _run(tmp_path, "iterable")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "RAISED" in run.stdout and "exited unexpectedly" in run.stdout, run.stdout
