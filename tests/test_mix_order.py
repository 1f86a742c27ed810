"""The mixed order alone (no loader): a pure function of (seed, position) with the promised
proportions, permutations, weight changes and resume at any world size and batch size."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest
from _mix_sources import EQUAL, SIXTEEN, WEIGHTS, Sized, identities, sixteen

from fastloader import Mix
from fastloader.sampling.interleave import Interleave, quantize
from fastloader.sampling.mix_order import MixOrder
from fastloader.sampling.mix_samplers import ElasticMixSampler
from fastloader.sampling.permutation import permute


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097, 65537])
def test_permutation_is_a_bijection(n):
    values = permute(np.arange(n), n, key=12345)
    assert sorted(values.tolist()) == list(range(n))


def test_permutations_differ_by_key_and_look_random():
    n = 100_000
    a, b = permute(np.arange(n), n, 1), permute(np.arange(n), n, 2)
    assert (a != b).mean() > 0.99
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.02  # no trend with the offset
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.02  # neighbours unrelated
    first_tenth = np.bincount(a[: n // 10] * 10 // n, minlength=10)  # spread over the range
    assert first_tenth.min() > 0.8 * n / 100


def _window_counts(sources: np.ndarray, count: int, width: int) -> np.ndarray:
    cumulative = np.zeros((count, len(sources) + 1))
    for s in range(count):
        cumulative[s, 1:] = np.cumsum(sources == s)
    return cumulative[:, width:] - cumulative[:, :-width]


def test_every_window_of_1000_holds_each_sources_share_within_one_sample_of_rounding():
    mix = sixteen()
    sources, _, _ = mix.order.indices(np.arange(3_000_000, 3_200_000))
    weights = np.array([WEIGHTS[name] for name in mix.order.names])
    share = weights / weights.sum()
    windows = _window_counts(sources, 16, 1000)
    expected = share[:, None] * 1000
    # every window's count is floor or ceil of the share, give or take one sample
    assert (windows >= np.floor(expected) - 1).all() and (windows <= np.ceil(expected) + 1).all()
    assert np.abs(windows - expected).max() < 2
    within_rounding = (windows >= np.floor(expected)) & (windows <= np.ceil(expected))
    assert within_rounding.mean() > 0.95  # almost always floor or ceil of the share


def test_the_interleave_counts_match_its_assignment():
    interleave = Interleave(quantize([5.0, 3.0, 1.5, 0.5, 0.0, 2.0]))
    sources, draws = interleave.assign(np.arange(50_000))
    for s in range(6):
        mine = draws[sources == s]
        assert mine.tolist() == list(range(len(mine)))  # draw numbers count up
    assert interleave.counts(50_000) == np.bincount(sources, minlength=6).tolist()
    assert interleave.counts(50_000)[4] == 0  # weight 0: never drawn


def test_the_order_is_a_pure_function_of_seed_and_position():
    mix = sixteen()
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 50_000_000, 5000)
    at_once = mix.order.indices(positions)[2]
    one_by_one = [mix.order.indices(np.array([p]))[2][0] for p in positions[:200]]
    assert at_once[:200].tolist() == one_by_one
    again = sixteen().order.indices(positions)[2]  # another object, same seed
    assert at_once.tolist() == again.tolist()
    assert sixteen(seed=12).order.indices(positions)[2].tolist() != at_once.tolist()


def test_each_source_epoch_is_a_fresh_permutation():
    mix = sixteen()
    order = mix.order
    small = order.index["s00"]
    n = order.sizes[small]
    sources, indices, _ = order.indices(np.arange(0, 1_500_000))
    mine = indices[sources == small]
    first, second = mine[:n], mine[n : 2 * n]
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    assert first.tolist() != second.tolist()  # reshuffled for its second epoch


def test_draws_before_a_far_position_need_no_replay_and_no_per_sample_memory():
    sizes = {f"s{i:02d}": 6_250_000 for i in range(16)}  # 10**8 samples in all
    tracemalloc.start()
    order = MixOrder(sizes, [(0, EQUAL | {"s00": 3.0}), (10**7, EQUAL)], seed=1)
    counts = order.draws_before(5 * 10**7)
    codes = order.indices(np.arange(5 * 10**7, 5 * 10**7 + 8192))[2]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sum(counts) == 5 * 10**7 and len(set(codes.tolist())) == 8192
    assert peak < 10 * 2**20  # the order state and one block: far below 10 MB
    assert len(pickle.dumps(order)) < 100_000


def test_a_weight_change_leaves_the_positions_before_it_alone():
    change = 123_457
    plain = sixteen()
    changed = sixteen(schedule={change: EQUAL})
    before = np.arange(change - 5000, change)
    assert plain.order.indices(before)[2].tolist() == changed.order.indices(before)[2].tolist()
    after = np.arange(change, change + 160_000)
    sources = changed.order.indices(after)[0]
    assert np.abs(np.bincount(sources, minlength=16) - 10_000).max() <= 2  # equal from there


def _global_order(mix, world, batch, epoch, start, count):
    """The (source, index) identities a world of ranks reads from ``start``, step by step."""
    samplers = [
        ElasticMixSampler(mix, batch, num_replicas=world, rank=r, shuffle=True)
        for r in range(world)
    ]
    streams = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        streams.append(sampler.iter_from(start))
    out = []
    while len(out) < count:
        for stream in streams:
            out += [next(stream) for _ in range(batch)]
    return identities(mix, out[:count])


@pytest.mark.parametrize("change", ["none", "before", "after"])
def test_resume_on_another_world_size_and_batch_reads_the_same_next_100k(change):
    rng = np.random.default_rng({"none": 1, "before": 2, "after": 3}[change])
    epoch, length = 1, 2 * max(SIXTEEN.values())
    step = 64 * 4
    start = int(rng.integers(1, (length - 200_000) // step)) * step  # a state between steps
    stream_start = epoch * length + start
    at = {"none": None, "before": stream_start - 7_777, "after": stream_start + 33_333}[change]
    schedule = None if at is None else {at: EQUAL}
    uninterrupted = _global_order(sixteen(schedule), 4, 64, epoch, start, 100_000)
    resumed = _global_order(sixteen(schedule), 3, 48, epoch, start, 100_000)
    assert resumed == uninterrupted
    names = {name for name, _ in uninterrupted}
    assert len(names) == 16  # every source was read


def test_state_is_small_and_does_not_grow_with_the_position():
    mix = sixteen(schedule={10**6: EQUAL, 2 * 10**6: WEIGHTS})
    state = mix.state_dict()
    assert len(pickle.dumps(state)) < 10_000 and len(repr(state)) < 10_000
    assert len(state["sources"]) == 16


def test_policies_end_epochs_where_they_say():
    sources = {"big": Sized(1000), "small": Sized(100)}
    weights = {"big": 1.0, "small": 1.0}
    first = Mix(sources, weights, policy="first_exhausted", seed=0)
    s, i, _ = first.order.indices(np.arange(len(first)))
    small = first.order.index["small"]
    assert s[-1] == small and (s == small).sum() == 100  # ends with the small source's last
    assert sorted(i[s == small].tolist()) == list(range(100))
    everything = Mix(sources, weights, policy="all_exhausted", seed=0)
    s, i, _ = everything.order.indices(np.arange(len(everything)))
    assert sorted(i[s == everything.order.index["big"]].tolist()) == list(range(1000))
    assert (s == everything.order.index["small"]).sum() >= 999  # cycled meanwhile
    once = Mix(sources, weights, policy="once", seed=0)
    s, i, _ = once.order.indices(np.arange(len(once)))
    assert len(once) == 1100
    assert sorted(zip(s.tolist(), i.tolist(), strict=True)) == sorted(
        [(0, k) for k in range(1000)] + [(1, k) for k in range(100)]
    )
    epoch_two = once.order.indices(np.arange(1100, 2200))  # a new pass, reshuffled
    assert epoch_two[1].tolist() != i.tolist()


def test_replacement_and_iid_draw_in_range_and_by_weight():
    sources = {"a": Sized(10), "b": Sized(1000)}
    mix = Mix(sources, {"a": 1.0, "b": 3.0}, policy="replacement", interleave="iid", seed=0)
    s, i, _ = mix.order.indices(np.arange(40_000))
    assert 0.23 < (s == 0).mean() < 0.27
    assert i[s == 0].max() < 10 and i[s == 1].max() < 1000
    with pytest.raises(ValueError, match="replacement"):
        Mix(sources, {"a": 1.0, "b": 3.0}, interleave="iid")


def test_bad_arguments_name_what_is_wrong():
    sources = {"a": Sized(10), "b": Sized(5)}
    with pytest.raises(ValueError, match="unknown sources"):
        Mix(sources, {"a": 1.0, "b": 1.0, "c": 1.0})
    with pytest.raises(ValueError, match="missing"):
        Mix(sources, {"a": 1.0})
    with pytest.raises(ValueError, match=r"weights\['b'\]"):
        Mix(sources, {"a": 1.0, "b": -1.0})
    with pytest.raises(ValueError, match="is empty"):
        Mix({"a": Sized(0)})
    with pytest.raises(ValueError, match="cannot change weights"):
        Mix(sources, policy="first_exhausted", schedule={10: {"a": 1.0, "b": 0.0}})
    with pytest.raises(ValueError, match="pass at="):
        Mix(sources).set_weights({"a": 1.0, "b": 1.0})
