"""Exact mid-epoch resume: state_dict/load_state_dict."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _datasets import RandomDraws

from fastloader import DataLoader


def _loader(num_workers, seed=21):
    return DataLoader(
        RandomDraws(22), batch_size=4, shuffle=True, num_workers=num_workers, seed=seed
    )


def _uninterrupted(epochs=3):
    loader = _loader(0)
    return [values for _ in range(epochs) for values, _ in loader]


@pytest.mark.parametrize(("before", "after"), [(0, 0), (2, 1), (0, 2), (1, 0)])
def test_resumed_loader_yields_exactly_the_remaining_batches(before, after):
    expected = _uninterrupted()
    per_epoch = len(expected) // 3
    stop_epoch, stop_batch = 1, 3

    first = _loader(before)
    seen = []
    for epoch in range(stop_epoch + 1):
        for values, _ in first:
            seen.append(values)
            if epoch == stop_epoch and len(seen) == per_epoch * stop_epoch + stop_batch:
                break
    state = json.loads(json.dumps(first.state_dict()))  # small and JSON-able
    first.close()
    assert state["epoch"] == stop_epoch and state["batches_consumed"] == stop_batch

    resumed = _loader(after, seed=None)  # the seed comes from the state
    resumed.load_state_dict(state)
    rest = [values for values, _ in resumed]
    rest += [values for values, _ in resumed]
    resumed.close()
    assert len(seen) + len(rest) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(seen + rest, expected, strict=False))


def test_state_after_a_complete_epoch_resumes_at_the_next_epoch():
    expected = _uninterrupted(2)
    first = _loader(0)
    list(first)
    resumed = _loader(0, seed=None)
    resumed.load_state_dict(first.state_dict())
    assert all(
        torch.equal(a, b)
        for (a, _), b in zip(resumed, expected[len(expected) // 2 :], strict=False)
    )
    assert resumed.epoch == 1


def test_resume_in_another_process(tmp_path: Path):
    first = _loader(1)
    iterator = iter(first)
    consumed = [next(iterator)[0] for _ in range(2)]
    (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
    first.close()
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _datasets import RandomDraws
        from fastloader import DataLoader
        loader = DataLoader(RandomDraws(22), batch_size=4, shuffle=True, num_workers=1)
        loader.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
        torch.save([v for v, _ in loader], {str(tmp_path / "rest.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    rest = torch.load(tmp_path / "rest.pt")
    expected = _uninterrupted(1)
    assert all(torch.equal(a, b) for a, b in zip(consumed + rest, expected, strict=False))
    assert len(consumed) + len(rest) == len(expected)


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({}, "state_dict"),
        ({"fastloader_state_version": 99}, "version"),
        (
            {
                "fastloader_state_version": 1,
                "seed": 1,
                "epoch": -1,
                "batches_consumed": 0,
                "epoch_started": True,
                "epoch_complete": False,
            },
            "non-negative",
        ),
        (
            {
                "fastloader_state_version": 1,
                "seed": "x",
                "epoch": 0,
                "batches_consumed": 0,
                "epoch_started": True,
                "epoch_complete": False,
            },
            "seed",
        ),
    ],
)
def test_bad_state_is_rejected_with_a_clear_error(state, problem):
    with pytest.raises(ValueError, match=problem):
        _loader(0).load_state_dict(state)
