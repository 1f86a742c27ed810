"""fastloader.Mix read by real loaders: what a batch says, seeding, exact resume across worker
counts, batch sizes, world sizes and weight changes, refusals, and the realised proportions."""

from __future__ import annotations

import json
import time

import pytest
import torch
from _ddp import spawn_ranks
from _mix_ddp import EPOCH, run_rank
from _mix_ddp import mix as sixteen_sources
from _mix_sources import Numbered

from fastloader import DataLoader, Mix, MixSample

SOURCES = {"web": 300, "code": 120, "math": 40}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def three(**kwargs) -> Mix:
    kwargs.setdefault("weights", WEIGHTS)
    return Mix({name: Numbered(n) for name, n in SOURCES.items()}, **kwargs)


def rows(batch: MixSample) -> list[tuple]:
    return [
        (source, int(index), tuple(values.tolist()))
        for source, index, values in zip(batch.source, batch.index, batch.sample, strict=True)
    ]


def epoch_rows(loader, steps=None) -> list[tuple]:
    out = []
    for step, batch in enumerate(loader):
        out += rows(batch)
        if steps is not None and step + 1 == steps:
            break
    return out


def test_a_batch_says_which_source_each_sample_came_from():
    loader = DataLoader(three(), batch_size=16, seed=3)
    batch = next(iter(loader))
    assert isinstance(batch, MixSample)
    assert batch.index.dtype == torch.int64 and batch.sample.shape == (16, 4)
    assert set(batch.source) <= set(SOURCES)
    assert batch.sample[:, 0].long().tolist() == batch.index.tolist()  # the source's own index


def test_samples_are_seeded_the_same_for_any_worker_count_and_differ_per_draw():
    alone = epoch_rows(DataLoader(three(), batch_size=16, seed=3))
    with DataLoader(three(), batch_size=16, seed=3, num_workers=2) as loader:
        assert epoch_rows(loader) == alone
    twice = [row for row in alone if row[0] == "math"]
    by_index = {}
    for _, index, values in twice:
        by_index.setdefault(index, set()).add(values[1:])
    assert any(len(draws) > 1 for draws in by_index.values())  # read again: drawn afresh


def test_resume_with_other_workers_and_batch_size_continues_at_the_next_sample():
    with DataLoader(three(), batch_size=16, seed=3, num_workers=2) as loader:
        loader.set_epoch(1)
        seen = epoch_rows(loader, steps=7)
        state = json.loads(json.dumps(loader.state_dict()))
    clean = DataLoader(three(), batch_size=16, seed=3)
    clean.set_epoch(1)
    whole = epoch_rows(clean)
    resumed = DataLoader(three(), batch_size=12, seed=99)
    resumed.load_state_dict(state)
    assert seen + epoch_rows(resumed) == whole
    assert resumed.epoch == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_set_weights_takes_effect_at_the_next_unseen_sample_and_reruns_identically(workers):
    def run() -> tuple[list, int, dict]:
        with DataLoader(three(), batch_size=10, seed=3, num_workers=workers) as loader:
            out, at, state = [], None, None
            for step, batch in enumerate(loader):
                out += rows(batch)
                if step == 3:
                    at = loader.dataset.set_weights({"web": 0.0, "code": 1.0, "math": 1.0})
                if step == 8:
                    state = json.loads(json.dumps(loader.state_dict()))
            return out, at, state

    first, at, state = run()
    assert at == 40  # four batches of 10 were seen
    plain = epoch_rows(DataLoader(three(), batch_size=10, seed=3))
    assert first[:40] == plain[:40]
    assert "web" not in {source for source, _, _ in first[40:]}
    second, _, _ = run()
    assert second == first
    resumed = DataLoader(three(), batch_size=7, seed=3)
    resumed.load_state_dict(state)  # the change is in the state
    assert epoch_rows(resumed) == first[90:]


def test_set_weights_between_epochs_reaches_a_pool_that_prefetched_the_next_epoch():
    with DataLoader(three(), batch_size=10, seed=3, num_workers=2) as loader:
        epoch_rows(loader)
        time.sleep(0.2)  # the persistent workers load epoch 1 ahead
        at = loader.dataset.set_weights({"web": 0.0, "code": 0.0, "math": 1.0})
        assert at == len(loader.dataset)
        assert {source for source, _, _ in epoch_rows(loader)} == {"math"}


def test_a_schedule_changes_the_weights_at_its_position():
    loader = DataLoader(three(schedule={200: {"web": 1.0, "code": 0.0, "math": 0.0}}), 10)
    taken = epoch_rows(loader)
    assert {source for source, _, _ in taken[200:]} == {"web"}
    assert {source for source, _, _ in taken[:200]} == set(SOURCES)


def _state_mid_epoch(mix: Mix) -> dict:
    loader = DataLoader(mix, batch_size=10, seed=3)
    epoch_rows(loader, steps=5)
    return json.loads(json.dumps(loader.state_dict()))


def test_resume_refuses_a_changed_set_of_sources_naming_the_source():
    state = _state_mid_epoch(three())
    fewer = Mix({n: Numbered(SOURCES[n]) for n in ("web", "code")}, {"web": 1.0, "code": 1.0})
    with pytest.raises(ValueError, match="source 'math' is in the state but not in this Mix"):
        DataLoader(fewer, batch_size=10).load_state_dict(state)
    more = Mix({**{n: Numbered(k) for n, k in SOURCES.items()}, "chat": Numbered(5)})
    with pytest.raises(ValueError, match="source 'chat' is in this Mix but not in the state"):
        DataLoader(more, batch_size=10).load_state_dict(state)
    bigger = {**{n: Numbered(k) for n, k in SOURCES.items()}, "code": Numbered(121)}
    with pytest.raises(ValueError, match="source 'code' has 121 samples, the state's had 120"):
        DataLoader(Mix(bigger, WEIGHTS), batch_size=10).load_state_dict(state)
    with pytest.raises(ValueError, match=r"mix.weights differ at position 0"):
        DataLoader(three(weights={**WEIGHTS, "web": 0.6}), 10).load_state_dict(state)
    with pytest.raises(ValueError, match=r"mix.policy differs"):
        DataLoader(three(policy="replacement"), batch_size=10).load_state_dict(state)
    reordered = Mix({n: Numbered(SOURCES[n]) for n in ("math", "web", "code")}, WEIGHTS)
    DataLoader(reordered, batch_size=10).load_state_dict(state)  # names, not dict order


def test_reweight_continues_each_remaining_source_where_its_draws_stopped():
    sources = {name: Numbered(n) for name, n in SOURCES.items()}
    state = _state_mid_epoch(Mix(sources, WEIGHTS, samples_per_epoch=400))
    keep = {"web": sources["web"], "code": sources["code"]}
    later = Mix(keep, {"web": 0.5, "code": 0.5}, samples_per_epoch=400, on_change="reweight")
    loader = DataLoader(later, batch_size=10)
    loader.load_state_dict(state)
    resumed = epoch_rows(loader)
    uninterrupted = DataLoader(Mix(sources, WEIGHTS, samples_per_epoch=400), 10, seed=3)
    rest = epoch_rows(uninterrupted)[50:]
    for name in keep:  # each source's next draws are the ones it had still due
        mine = [index for source, index, _ in resumed if source == name]
        theirs = [index for source, index, _ in rest if source == name]
        common = min(len(mine), len(theirs))
        assert common > 10 and mine[:common] == theirs[:common]
    assert "math" not in {source for source, _, _ in resumed}
    again = DataLoader(later, batch_size=10)  # the change is recorded: a resume repeats it
    again.load_state_dict(loader.state_dict())


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda mix: mix["sources"].update(web="300"), r"mix.sources\['web'\]"),
        (lambda mix: mix["weights"].append([0, "call", {"web": 1.0}]), r"mix.weights\[1\]\[0\]"),
        (lambda mix: mix["weights"][0][2].update(web=-1.0), r"mix.weights\[0\]\[2\]\['web'\]"),
        (lambda mix: mix.update(policy="sometimes"), "mix.policy"),
        (lambda mix: mix.update(extra=1), "mix has an unknown field 'extra'"),
        (lambda mix: mix.pop("seed"), "mix.seed is missing"),
        (lambda mix: mix.update(seed=True), "mix.seed"),
    ],
)
def test_a_crafted_mix_state_is_refused_naming_the_field(edit, field):
    state = _state_mid_epoch(three())
    edit(state["mix"])
    with pytest.raises(ValueError, match=field):
        DataLoader(three(), batch_size=10).load_state_dict(state)


def test_a_mix_state_and_a_plain_loader_do_not_mix():
    state = _state_mid_epoch(three())
    with pytest.raises(ValueError, match="the state is of a Mix"):
        DataLoader(Numbered(460), batch_size=10).load_state_dict(state)
    plain = DataLoader(Numbered(460), batch_size=10, shuffle=True)
    epoch_rows_plain = iter(plain)
    next(epoch_rows_plain)
    with pytest.raises(ValueError, match="without its mix"):
        DataLoader(three(), batch_size=10).load_state_dict(plain.state_dict())


def test_stats_report_the_realised_share_of_each_source():
    loader = DataLoader(three(samples_per_epoch=1000), batch_size=20, seed=3)
    epoch_rows(loader)
    epoch = loader.stats.last
    assert sum(epoch.sources.values()) == epoch.samples == 1000
    assert epoch.sources == {"code": 300, "math": 200, "web": 500}
    assert "sources code 30.0% math 20.0% web 50.0%" in loader.stats.summary()
    assert loader.stats.as_dict()["epochs"][0]["sources"] == epoch.sources


def test_the_lightning_callback_logs_each_sources_share():
    pytest.importorskip("lightning")
    from fastloader.lightning import LoaderStatsMonitor

    loader = DataLoader(three(samples_per_epoch=1000), batch_size=20, seed=3)
    epoch_rows(loader)
    logged = {}

    class Module:
        def log_dict(self, metrics, **kwargs):
            logged.update(metrics)

    class Trainer:
        train_dataloader = loader

    LoaderStatsMonitor().on_train_epoch_end(Trainer(), Module())
    assert logged["data/source_share/web"] == pytest.approx(0.5)


def test_state_dict_of_sixteen_sources_is_small():
    loader = DataLoader(sixteen_sources(), batch_size=64, seed=3)
    epoch_rows(loader, steps=3)
    assert len(json.dumps(loader.state_dict())) < 10_000


def _spawn(tmp, name, world_size, plan):
    return spawn_ranks(run_rank, tmp / name, world_size, plan)


def _global(ranks) -> list:
    return [
        row for step in range(len(ranks[0]["steps"])) for r in ranks for row in r["steps"][step]
    ]


@pytest.mark.slow
def test_gloo_ranks_resume_4_to_3_workers_2_to_0_batch_64_to_48_across_weight_changes(tmp_path):
    length = 2 * 10**6
    schedule = {EPOCH * length + 26 * 256 + 100: {f"s{i:02d}": 1.0 + i for i in range(16)}}
    plan = {"batch_size": 64, "num_workers": 2, "steps": 30, "schedule": schedule}
    four = _spawn(tmp_path, "four", 4, {**plan, "change_at_step": 10, "save_at_step": 20})
    assert {r["changed_at"] for r in four} == {EPOCH * length + 11 * 256}
    (tmp_path / "state.json").write_text(json.dumps(four[2]["state"]))
    resume = {"batch_size": 48, "num_workers": 0, "steps": 16, "schedule": schedule}
    three_ranks = _spawn(
        tmp_path,
        "three",
        3,
        {**resume, "resume": str(tmp_path / "state.json"), "eval": {"a": 10, "b": 23, "c": 1}},
    )
    uninterrupted = _global(four)[21 * 256 :]
    resumed = _global(three_ranks)[: len(uninterrupted)]
    assert len(uninterrupted) == 9 * 256
    assert resumed == uninterrupted  # sources, indices and every seeded draw
    assert len({row[0] for row in uninterrupted}) == 16
    for rank in three_ranks:  # evaluation: every sample of every source once
        assert rank["eval"] == [
            f"{s}:{i}" for s, n in (("a", 10), ("b", 23), ("c", 1)) for i in range(n)
        ]


def test_a_distributed_state_resumes_a_single_process_loader():
    from fastloader.sampling.mix_samplers import ElasticMixSampler

    mix = three()
    rank0 = DataLoader(mix, batch_size=8, sampler=ElasticMixSampler(mix, 8, 2, 0), seed=3)
    epoch_rows(rank0, steps=3)  # 3 global steps of 2 ranks x 8: 48 samples seen
    state = json.loads(json.dumps(rank0.state_dict()))
    assert state["position"] == 48
    single = DataLoader(three(), batch_size=10, seed=3)
    single.load_state_dict(state)
    assert epoch_rows(single) == epoch_rows(DataLoader(three(), batch_size=10, seed=3))[48:]


def test_a_worker_killed_by_a_source_is_replaced_and_the_epoch_is_unchanged(tmp_path):
    from _mix_sources import DiesOnce

    def mix(marker: str) -> Mix:
        sources = {"web": Numbered(300), "code": DiesOnce(120, 7, marker), "math": Numbered(40)}
        return Mix(sources, WEIGHTS)

    clean = epoch_rows(DataLoader(mix(str(tmp_path / "unused")), batch_size=10, seed=3))
    with DataLoader(mix(str(tmp_path / "died")), batch_size=10, seed=3, num_workers=2) as loader:
        assert epoch_rows(loader) == clean
    assert (tmp_path / "died").exists()  # a worker did die


@pytest.mark.parametrize(
    "sample",
    [
        lambda i: torch.full((3,), float(i)),
        lambda i: {"x": torch.tensor([i, i]), "label": i},
        lambda i: (torch.tensor(float(i)), i % 3),
        lambda i: i,
    ],
    ids=["tensor", "dict", "tuple", "int"],
)
def test_the_loaders_collate_of_mix_samples_equals_torchs_default_collate(sample):
    from torch.utils.data import default_collate as torch_collate

    from fastloader.loader.mixing import MixCollate

    batch = [MixSample(sample(i), ("web", "code")[i % 2], 10 * i) for i in range(5)]
    ours, theirs = MixCollate(torch_collate)(batch), torch_collate(batch)
    assert type(ours) is MixSample and ours.source == theirs.source
    assert ours.index.dtype == theirs.index.dtype and torch.equal(ours.index, theirs.index)
    assert repr(ours.sample) == repr(theirs.sample)


def test_a_call_at_a_scheduled_position_replaces_it_and_resumes():
    only = {name: {other: float(other == name) for other in SOURCES} for name in SOURCES}
    schedule = {40: only["web"], 200: only["math"]}
    loader = DataLoader(three(schedule=schedule), batch_size=10, seed=3)
    taken = []
    for step, batch in enumerate(loader):
        taken += rows(batch)
        if step == 3:  # the next unseen sample is 40: the scheduled position
            assert loader.dataset.set_weights(only["code"]) == 40
        if step == 9:
            state = json.loads(json.dumps(loader.state_dict()))
    assert {source for source, _, _ in taken[40:200]} == {"code"}  # the call won
    assert {source for source, _, _ in taken[200:]} == {"math"}  # the schedule after it holds
    resumed = DataLoader(three(schedule=schedule), batch_size=10, seed=3)
    resumed.load_state_dict(state)
    assert epoch_rows(resumed) == taken[100:]
