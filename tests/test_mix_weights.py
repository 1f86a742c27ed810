"""Mix weights at the edges of floating point: a sum that overflows, a weight no float holds,
and a share too small to draw at its rate (NOTE [ Weights that overflow or vanish ])."""

from __future__ import annotations

import numpy as np
import pytest
from _mix_sources import Sized

from fastloader import DataLoader, Mix

NAMES = ("a", "b", "c")


def mix(weights=None, **kwargs) -> Mix:
    return Mix({name: Sized(1000) for name in NAMES}, weights, **kwargs)


def order(m: Mix, n: int = 3000) -> list[tuple[int, int]]:
    sources, indices, _ = m.order.indices(np.arange(n))
    return list(zip(sources.tolist(), indices.tolist(), strict=True))


def test_weights_whose_sum_overflows_keep_their_proportions():
    huge = mix({"a": 1.5e308, "b": 1e308, "c": 0.5e308}, seed=1)  # sum: inf
    small = mix({"a": 1.5, "b": 1.0, "c": 0.5}, seed=1)
    assert huge.realised(0, 3000) == {"a": 1500, "b": 1000, "c": 500}
    assert order(huge) == order(small)  # the same order as the same proportions at any scale


def test_a_schedule_and_set_weights_whose_sum_overflows_keep_their_proportions():
    m = mix({"a": 1.0, "b": 1.0, "c": 1.0}, schedule={300: dict.fromkeys(NAMES, 1e308)}, seed=2)
    assert m.realised(300, 3300) == {"a": 1000, "b": 1000, "c": 1000}
    m.set_weights({"a": 1e308, "b": 1e308, "c": 1e307}, at=600)
    assert m.realised(600, 600 + 2100) == {"a": 1000, "b": 1000, "c": 100}


def test_a_tiny_weight_beside_an_overflowing_sum_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"weights\['c'\] \(5e-309 of the total\): below"):
        mix({"a": 1e308, "b": 1e308, "c": 1.0})


@pytest.mark.parametrize("big", [10**400, -(10**400)], ids=["10**400", "-10**400"])
def test_a_weight_no_float_holds_is_a_value_error_naming_it(big):
    with pytest.raises(ValueError, match=r"weights\['b'\] must be a finite number >= 0"):
        mix({"a": 1.0, "b": big, "c": 1.0})
    with pytest.raises(ValueError, match=r"schedule\[10\]\['b'\] must be a finite"):
        mix({"a": 1.0, "b": 1.0, "c": 1.0}, schedule={10: {"a": 1.0, "b": big, "c": 1.0}})
    with pytest.raises(ValueError, match=r"weights\['b'\] must be a finite number"):
        mix({"a": 1.0, "b": 1.0, "c": 1.0}).set_weights({"a": 1, "b": big, "c": 1}, at=10)


def test_a_state_with_a_weight_no_float_holds_is_refused_naming_the_field():
    loader = DataLoader(mix({"a": 1.0, "b": 1.0, "c": 1.0}), batch_size=10)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["mix"]["weights"][0][2]["b"] = 10**400
    with pytest.raises(ValueError, match=r"mix.weights\[0\]\[2\]\['b'\] must be a finite"):
        DataLoader(mix({"a": 1.0, "b": 1.0, "c": 1.0}), batch_size=10).load_state_dict(state)


def test_a_weight_too_small_for_its_share_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"weights\['c'\] \(1e-09 of the total\)") as error:
        mix({"a": 0.5, "b": 0.5, "c": 1e-9})
    assert "Give it weight 0 or at least 4.77e-07 of the total" in str(error.value)
    with pytest.raises(ValueError, match=r"weights\['a'\] \(1e-09 of the total\)"):
        mix({"a": 1.0, "b": 1.0, "c": 1.0}).set_weights({"a": 2e-9, "b": 1, "c": 1}, at=10)
    with pytest.raises(ValueError, match=r"schedule\[5\]\['b'\]"):
        mix({"a": 1.0, "b": 1.0, "c": 1.0}, schedule={5: {"a": 1, "b": 1e-12, "c": 0}})


def test_default_weights_too_small_for_a_share_say_they_are_the_sizes():
    with pytest.raises(ValueError, match=r"by default the sources' sizes\)\['tiny'\]"):
        Mix({"big": Sized(3_000_000), "tiny": Sized(1)})


def test_small_weights_at_the_resolution_are_drawn_at_their_rate():
    m = mix({"a": 1.0, "b": 1.0, "c": 2e-6}, seed=3)  # c: 1e-6 of the total, one part in 2**20
    n = 1 << 22
    assert m.realised(0, n)["c"] == 4  # 4 of 2**22: the rate of one part in 2**20
    assert mix({"a": 1.0, "b": 1.0, "c": 0.0}).realised(0, n)["c"] == 0  # weight 0: never
