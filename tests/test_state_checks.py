"""validate_state: a crafted or damaged loader state is refused field by field, in a short message
naming the field; every state the real loader writes passes."""

import copy
import json
import time

import pytest
import torch
from _datasets import CountingStream, RandomDraws
from _states import VERSION_1_MID_EPOCH
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from fastloader import DataLoader
from fastloader.loader.state_checks import MAX_MESSAGE, validate_state
from fastloader.sampling.distributed import ElasticDistributedSampler


def _mid_epoch_state():
    loader = DataLoader(RandomDraws(22), batch_size=4, shuffle=True, seed=3)
    for taken, _ in enumerate(loader, start=1):
        if taken == 2:
            break
    state = json.loads(json.dumps(loader.state_dict()))  # as read back from a checkpoint
    loader.close()
    return state


def _real_states():
    """States of loaders of every sampler kind, at the start, mid-epoch and after an epoch."""
    loaders = [
        DataLoader(RandomDraws(22), batch_size=4, shuffle=True, seed=3),
        DataLoader(RandomDraws(22), batch_size=4, seed=2**64 - 1),
        DataLoader(RandomDraws(22), batch_size=None, seed=-(2**63)),
        DataLoader(RandomDraws(10), batch_size=3, sampler=[3, 1, 2, 0]),
        DataLoader(
            RandomDraws(10), batch_sampler=BatchSampler(SequentialSampler(range(10)), 3, False)
        ),
        DataLoader(
            RandomDraws(10), batch_size=2, sampler=DistributedSampler(range(10), 4, 3, seed=7)
        ),
        DataLoader(
            RandomDraws(10),
            batch_size=2,
            sampler=ElasticDistributedSampler(range(10), 2, num_replicas=3, rank=2, seed=5),
        ),
        DataLoader(CountingStream(6), batch_size=2),
    ]
    states = []
    for loader in loaders:
        states.append(loader.state_dict())
        for _ in zip(range(1), loader, strict=False):
            states.append(loader.state_dict())
        list(loader)
        states.append(loader.state_dict())
        loader.close()
    return states


def test_states_the_loader_writes_pass():
    states = _real_states()
    assert len(states) == 24
    for state in states:
        validate_state(state)
        validate_state(json.loads(json.dumps(state)))


def test_a_real_state_passes_after_validation_and_resumes():
    state = _mid_epoch_state()
    validate_state(state)
    resumed = DataLoader(RandomDraws(22), batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert sum(len(values) for values, _ in resumed) == 22 - 8


def _with(path, value):
    state = _mid_epoch_state()
    target = state
    *parents, last = path.split(".")
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return state


_DELETE = object()

_CRAFTED = [
    ("batch_size", 3e9, "batch_size must be an int"),
    ("batch_size", 3_000_000_000, "batch_size must be from 1"),
    ("batch_size", 0, "batch_size must be from 1"),
    ("order.world_size", "x", "order.world_size must be an int"),
    ("order.world_size", 0, "order.world_size must be from 1"),
    ("order.sampler_seed", 2**70, "order.sampler_seed must be from .* an int of 71 bits"),
    ("seed", 2**64, "seed must be from"),
    ("seed", 10**5000, "seed must be from .* an int of 16610 bits"),
    ("seed", True, "seed must be an int"),
    ("seed", 1.0, "seed must be an int"),
    ("epoch", -1, "epoch must be non-negative, got -1"),
    ("position", -8, "position must be non-negative"),
    ("position", 40, r"position \(40\) is past the end of the epoch \(order.epoch_length 22\)"),
    ("position", "8", "position must be an int"),
    ("epoch_started", "yes", "epoch_started must be True or False"),
    ("epoch_complete", 0, "epoch_complete must be True or False"),
    ("unit", "bytes", "unit must be one of"),
    ("unit", "batches", "unit is 'batches', which does not match order.sampler"),
    ("order", [], "order must be a dict"),
    ("order.sampler", "x" * 10_000_000, "order.sampler is too long"),
    ("order.sampler", ["shuffle"], "order.sampler must be a str"),
    ("order.shuffle", "True", "order.shuffle must be True, False or None"),
    ("order.rank", 5, "order.rank .5. must be below order.world_size .1."),
    ("order.indices_crc", -1, "order.indices_crc must be non-negative"),
    ("order.in_order", None, "order.in_order must be True or False"),
    ("order.epoch_length", 2**63, "order.epoch_length must be from 0"),
    ("order.dataset_length", {"n": 1}, "order.dataset_length must be an int or None"),
    ("order.extra", 1, "order has an unknown field 'extra'"),
    ("extra", "x" * 10_000_000, "state has an unknown field 'extra'"),
    ("position", _DELETE, "position is missing"),
    ("order.drop_last", _DELETE, "order.drop_last is missing"),
    ("fastloader_state_version", 3, "unsupported fastloader state version 3"),
    ("fastloader_state_version", True, "unsupported fastloader state version True"),
    ("fastloader_state_version", "x" * 10_000_000, "unsupported .* str of 10000000 characters"),
]


@pytest.mark.parametrize(("path", "value", "message"), _CRAFTED, ids=[c[0] for c in _CRAFTED])
def test_a_crafted_field_is_refused_naming_it_in_a_short_message(path, value, message):
    state = _with(path, value)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message) as error:
        validate_state(state)
    assert len(str(error.value)) <= MAX_MESSAGE
    assert time.perf_counter() - started < 1  # never formats a huge value; generous bound


def test_a_position_in_an_epoch_that_did_not_start_is_refused():
    state = _with("epoch_started", False)
    state["position"] = 40
    with pytest.raises(ValueError, match="position is 40 but epoch_started is False"):
        validate_state(state)


def test_a_complete_epoch_that_did_not_start_is_refused():
    state = _with("epoch_started", False)
    state.update(position=0, batches_consumed=0, epoch_complete=True)
    with pytest.raises(ValueError, match="epoch_complete is True but epoch_started is False"):
        validate_state(state)


def test_sampler_seed_plus_epoch_must_fit_in_64_bits():
    state = _with("order.sampler_seed", 2**64 - 1)
    state["epoch"] = 1
    with pytest.raises(ValueError, match="sampler_seed plus epoch"):
        validate_state(state)


def test_a_non_string_key_is_refused():
    state = _mid_epoch_state()
    state[7] = 1
    with pytest.raises(ValueError, match="key that is not a str: 7"):
        validate_state(state)


@pytest.mark.parametrize("state", [None, [], {}, "state", {"fastloader_state_version": [1]}])
def test_not_a_state_at_all_is_refused(state):
    with pytest.raises(ValueError, match="state"):
        validate_state(state)


def test_version_1_states_are_still_checked():
    legacy = dict(VERSION_1_MID_EPOCH)
    validate_state(legacy)
    broken = copy.deepcopy(legacy)
    broken["batches_consumed"] = 2**64
    with pytest.raises(ValueError, match="batches_consumed must be from 0"):
        validate_state(broken)
    extended = dict(legacy, position=3)
    with pytest.raises(ValueError, match="unknown field 'position'"):
        validate_state(extended)


def test_a_tensor_value_is_refused_without_formatting_it():
    state = _with("order.dataset_length", torch.zeros(10_000_000))
    with pytest.raises(ValueError, match="dataset_length must be an int or None, got a Tensor"):
        validate_state(state)
