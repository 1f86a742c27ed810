"""Batches per message (NOTE [ Batches per message ]): cheap batches travel several to a task
and a slot region, and every guarantee of one batch per message still holds.

The group size is decided from timing; ``MESSAGE_S`` is raised here so that groups of
``MAX_GROUP`` form on any machine from the ``DECIDE_AT``-th batch of the first epoch on.
Scenarios that kill workers run in their own process (tests/_group_scenarios.py).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import Dataset

from fastloader import DataLoader, Mix
from fastloader.loader.transport import groups

SCENARIOS = os.path.join(os.path.dirname(__file__), "_group_scenarios.py")


@pytest.fixture(autouse=True)
def groups_form(monkeypatch):
    monkeypatch.setattr(groups, "MESSAGE_S", 10.0)


class Records(Dataset):
    """A cheap sample: a tensor, a NumPy-free number and a string; sample 250 may raise."""

    def __init__(self, length: int = 800, fails: bool = False) -> None:
        self.length = length
        self.fails = fails

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if self.fails and i == 250:
            raise KeyError(f"sample {i}")
        return {"x": torch.full((3,), i, dtype=torch.int64), "i": i, "name": f"s{i}"}


def _loaders(dataset: Dataset, **kwargs) -> tuple[DataLoader, DataLoader]:
    common = {"batch_size": 4, "shuffle": True, "seed": 5, **kwargs}
    return DataLoader(dataset, num_workers=2, **common), DataLoader(dataset, **common)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["x"], y["x"]) and x["i"].tolist() == y["i"].tolist()
        for x, y in zip(a, b, strict=True)
    )


def test_grouped_epochs_equal_in_process_epochs_and_kept_batches_stay_intact():
    grouped, alone = _loaders(Records())
    kept = [list(grouped) for _ in range(3)]  # every batch kept: their regions stay held
    assert grouped._iterator._groups.size == groups.MAX_GROUP
    assert grouped._iterator._prefetch_factor == 2  # messages in flight: 8 batches / 16, min 2
    for epoch in kept:
        assert _same(epoch, list(alone))
        assert all(b["name"] == [f"s{i}" for i in b["i"].tolist()] for b in epoch)
    grouped.close()


def test_a_batch_that_fails_inside_a_group_raises_alone_and_the_epoch_goes_on():
    grouped, alone = _loaders(Records(fails=True), shuffle=False)
    for loader in (grouped, alone):
        loader.outcomes = []
        for _ in range(2):
            iterator = iter(loader)
            while True:
                try:
                    loader.outcomes.append(next(iterator)["i"].tolist())
                except StopIteration:
                    break
                except KeyError as error:
                    loader.outcomes.append(f"KeyError, sample 250: {'sample 250' in str(error)}")
    assert grouped._iterator._groups.size == groups.MAX_GROUP  # epoch 2: batch 62 in a group
    assert grouped.outcomes == alone.outcomes
    assert sum(isinstance(o, str) for o in grouped.outcomes) == 2  # one batch, each epoch
    assert len(grouped.outcomes) == 2 * len(grouped)
    grouped.close()


def test_a_state_taken_inside_a_group_resumes_the_same_batches():
    grouped, alone = _loaders(Records())
    list(grouped)  # groups form in the first epoch; the second is sent in groups from batch 0
    iterator = iter(grouped)
    for _ in range(13):  # inside the first group
        next(iterator)
    assert grouped._iterator._groups.pending  # batches of this group not yet handed out
    state = json.loads(json.dumps(grouped.state_dict()))
    rest = list(iterator)
    resumed = DataLoader(Records(), batch_size=4, shuffle=True, seed=5, num_workers=2)
    resumed.load_state_dict(state)
    assert _same(list(resumed), rest)
    list(alone)
    assert _same(rest, list(alone)[13:])
    grouped.close()
    resumed.close()


def test_an_epoch_left_inside_a_group_does_not_leak_into_the_next():
    grouped, alone = _loaders(Records())
    list(grouped)  # groups form
    iterator = iter(grouped)
    for _ in range(13):
        next(iterator)
    assert grouped._iterator._groups.pending
    list(alone)
    list(alone)
    assert _same(list(grouped), list(alone))  # the next epoch, whole and alone
    grouped.close()


def test_out_of_order_delivery_in_groups_delivers_each_batch_once():
    grouped, alone = _loaders(Records(), in_order=False)
    for _ in range(2):
        got = sorted(i for batch in grouped for i in batch["i"].tolist())
        assert got == list(range(800))
    grouped.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"collate_fn": lambda samples: torch.tensor([s["i"] for s in samples])},
        {"prefetch_factor": 4},
    ],
    ids=["users_collate", "users_prefetch_factor"],
)
def test_a_users_collate_or_prefetch_factor_keeps_one_batch_per_message(kwargs):
    loader = DataLoader(Records(), batch_size=4, num_workers=2, **kwargs)
    for _ in range(2):
        assert len(list(loader)) == 200
    assert loader._iterator._groups.size == 1
    loader.close()


def test_a_mix_of_cheap_sources_travels_in_groups_with_the_same_batches():
    # a Mix's collate (MixCollate over the default) draws nothing: its batches may be grouped
    def mix() -> Mix:
        sources = {"a": Records(500), "b": Records(300)}
        return Mix(sources, weights={"a": 0.6, "b": 0.4})

    def rows(batch) -> list:
        x, i = batch.sample["x"][:, 0].tolist(), batch.sample["i"].tolist()
        return list(zip(batch.source, batch.index.tolist(), x, i, strict=True))

    grouped = DataLoader(mix(), batch_size=4, seed=5, num_workers=2)
    alone = DataLoader(mix(), batch_size=4, seed=5)
    epochs = [[row for batch in grouped for row in rows(batch)] for _ in range(2)]
    assert grouped._iterator._groups.size == groups.MAX_GROUP
    for epoch in epochs:
        assert epoch == [row for batch in alone for row in rows(batch)]
    grouped.close()


def _scenario(name: str) -> dict:
    done = subprocess.run(
        [sys.executable, SCENARIOS, name], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_killed_with_groups_in_flight_is_healed_and_batches_go_alone_after():
    report = _scenario("killed")
    assert report["size_before"] == groups.MAX_GROUP
    assert report["equal"]  # both epochs: every batch once, in order, as a clean run
    assert report["deaths_warned"] >= 1
    assert report["size_after"] == 1


def test_a_poison_sample_inside_a_group_raises_for_its_batch_alone():
    report = _scenario("poisoned")
    assert report["size_before"] == groups.MAX_GROUP  # batch 150 was sent inside a group
    for epoch in report["epochs"]:
        assert len(epoch) == 200  # every batch attempted, none missing, none extra
        assert [n for n, b in enumerate(epoch) if isinstance(b, str)] == [150]
        assert epoch[150].startswith("PoisonSampleError")
        assert "[300, 301]" in epoch[150]  # the poison batch's indices, not its group's
        assert all(b == [2 * n, 2 * n + 1] for n, b in enumerate(epoch) if n != 150)
