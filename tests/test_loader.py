"""fastloader.DataLoader: drop-in arguments, worker lifetime, epochs, errors."""

import gc
import inspect
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from _datasets import FailsAt, RandomDraws, RecordingSampler
from torch.utils.data import DataLoader as TorchDataLoader

from fastloader import DataLoader


def _pids(batches) -> set:
    return {int(pid) for _, pids in batches for pid in pids}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_is_a_torch_dataloader_accepting_every_torch_argument():
    ours = inspect.signature(DataLoader.__init__).parameters
    theirs = inspect.signature(TorchDataLoader.__init__).parameters
    assert issubclass(DataLoader, TorchDataLoader)
    for name, param in theirs.items():
        assert name in ours, name
        assert ours[name].kind == param.kind, name
    extras = set(ours) - set(theirs)
    assert all(ours[name].kind == inspect.Parameter.KEYWORD_ONLY for name in extras)


def test_same_batches_as_torch_without_shuffle():
    data = list(range(10))
    ours = [b.tolist() for b in DataLoader(data, batch_size=3)]
    theirs = [b.tolist() for b in TorchDataLoader(data, batch_size=3)]
    assert ours == theirs


def test_persistent_workers_default_follows_num_workers():
    assert DataLoader(range(4), num_workers=1).persistent_workers is True
    assert DataLoader(range(4), num_workers=0).persistent_workers is False
    assert DataLoader(range(4), num_workers=1, persistent_workers=False).persistent_workers is False


def test_extra_arguments_are_attributes_for_rebuilding():
    loader = DataLoader(range(4), num_workers=1, seed=5, device_prefetch=3)
    assert loader.seed == 5 and loader.device_prefetch == 3 and loader.distributed is False
    rebuilt = DataLoader(
        loader.dataset,
        num_workers=loader.num_workers,
        seed=loader.seed,
        device_prefetch=loader.device_prefetch,
    )
    assert [b.tolist() for b in rebuilt] == [b.tolist() for b in loader]


def test_workers_start_once_and_serve_every_epoch():
    loader = DataLoader(RandomDraws(12), batch_size=4, shuffle=True, num_workers=2)
    seen = [_pids(list(loader)) for _ in range(3)]
    assert len(seen[0]) == 2 and seen[0] == seen[1] == seen[2]
    loader.close()


def test_workers_survive_iterator_reset():
    # Lightning 1.5.0 set `loader._iterator = None` every epoch (Lightning issue 10389).
    loader = DataLoader(RandomDraws(12), batch_size=4, num_workers=2)
    first = _pids(list(loader))
    for _ in range(2):
        loader._iterator = None
        assert _pids(list(loader)) == first
    loader.close()


def test_workers_survive_early_break_and_next_epoch_is_complete():
    loader = DataLoader(RandomDraws(12), batch_size=2, shuffle=True, num_workers=2, seed=3)
    reference = DataLoader(RandomDraws(12), batch_size=2, shuffle=True, seed=3)
    ref_epochs = [[b[0] for b in reference] for _ in range(3)]

    iterator = iter(loader)
    first = next(iterator)
    pids = set(first[1].tolist())
    assert torch.equal(first[0], ref_epochs[0][0])
    # leave epoch 0 early; epochs 1 and 2 are complete and identical to the reference
    for epoch in (1, 2):
        batches = list(loader)
        assert len(batches) == len(ref_epochs[epoch])
        assert all(torch.equal(a[0], b) for a, b in zip(batches, ref_epochs[epoch], strict=False))
        pids |= _pids(batches)
    assert len(pids) == 2  # the same two workers throughout
    loader.close()


def test_len_does_not_restart_workers():
    loader = DataLoader(RandomDraws(12), batch_size=4, num_workers=2)
    first = _pids(list(loader))
    assert len(loader) == 3
    assert _pids(list(loader)) == first
    loader.close()


def test_close_stops_workers_and_loader_still_works():
    loader = DataLoader(RandomDraws(8), batch_size=4, num_workers=2)
    list(loader)
    pids = loader.worker_pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    loader.close()
    assert loader.worker_pids == []
    assert _wait_dead(pids)
    assert len(list(loader)) == 2  # new workers on demand
    loader.close()


def test_context_manager_stops_workers():
    with DataLoader(RandomDraws(8), batch_size=4, num_workers=2) as loader:
        list(loader)
        pids = loader.worker_pids
    assert _wait_dead(pids)


def test_garbage_collected_loader_stops_workers():
    loader = DataLoader(RandomDraws(8), batch_size=4, num_workers=2)
    list(loader)
    pids = loader.worker_pids
    del loader
    gc.collect()
    assert _wait_dead(pids)


def test_interpreter_exit_does_not_hang_or_leak_workers(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from _datasets import RandomDraws
        from fastloader import DataLoader
        loader = DataLoader(RandomDraws(8), batch_size=2, num_workers=2, pin_memory=False)
        iterator = iter(loader)
        next(iterator)  # exit mid-epoch, workers busy
        print(" ".join(str(p) for p in loader.worker_pids), flush=True)
    """)
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2
    assert _wait_dead(pids)


def test_epoch_counts_started_epochs_and_reaches_the_sampler():
    sampler = RecordingSampler(6)
    loader = DataLoader(range(6), batch_size=2, sampler=sampler, num_workers=1)
    assert loader.epoch == 0
    for _ in range(3):
        list(loader)
    assert loader.epoch == 2
    # the next epoch may be set on the sampler ahead of time (cross-epoch prefetch)
    assert sampler.epochs[:3] == [0, 1, 2]
    loader.set_epoch(7)
    list(loader)
    assert loader.epoch == 7 and sampler.epochs[-1] in (7, 8) and 7 in sampler.epochs
    loader.close()


def test_set_epoch_reaches_distributed_sampler_without_user_code():
    dataset = list(range(8))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, seed=1)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    orders = [next(iter(loader)).tolist() for _ in range(2)]
    assert orders[0] != orders[1]  # reshuffled because set_epoch was called
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expected.append(list(iter(sampler)))
    assert orders == expected


def test_num_workers_auto_uses_available_cpus():
    loader = DataLoader(range(4), num_workers="auto")
    cpus = len(os.sched_getaffinity(0))
    assert loader.num_workers == max(1, cpus - 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"num_workers": -1}, ValueError, "num_workers option should be non-negative"),
        ({"num_workers": "many"}, ValueError, "num_workers"),
        ({"seed": "abc"}, TypeError, "seed"),
        ({"seed": 1.0}, TypeError, "seed"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"device_prefetch": 0}, ValueError, "device_prefetch"),
        ({"shuffle": True, "sampler": [0, 1]}, ValueError, "shuffle"),
        ({"num_workers": 0, "prefetch_factor": 2}, ValueError, "prefetch_factor"),
        ({"num_workers": 0, "persistent_workers": True}, ValueError, "persistent_workers"),
        ({"distributed": True}, RuntimeError, "process group"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, error, names):
    with pytest.raises(error, match=names):
        DataLoader(list(range(4)), **kwargs)


def test_set_epoch_rejects_bad_values():
    loader = DataLoader(range(4))
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_error_keeps_type_and_message_and_names_the_index(num_workers):
    loader = DataLoader(FailsAt(5), batch_size=2, num_workers=num_workers)
    with pytest.raises(ValueError, match="cannot decode sample 5") as info:
        list(loader)
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "sample index 5" in text
    loader.close()
