"""Checking a loader state field by field before anything is built from it.

Runs in the main process, in ``load_state_dict``, before ``loader/resume.py`` reads the state.

NOTE [ Validating a loader state ]

A state comes from a checkpoint file, which may be old, edited, damaged or crafted. Every
field is checked before any value is used: its type (an int is an int, not a bool or a float),
its range (counters non-negative, seeds within the 64 bits the RNGs take, sizes below what any
loader can have), the size of strings, and the consistency between fields (a position in an
epoch that did not start, a rank outside the world size, a position past the epoch's length).
So a bad state fails at once with a ValueError naming the field, never later with an overflow,
a TypeError naming nothing, or a huge allocation. Values are never formatted whole: a message
shows at most ``_SHOWN`` characters of a value (an int of thousands of digits is described by
its size, not printed), and the whole message is cut at ``MAX_MESSAGE``.

Unknown fields are refused: each version's fields are listed here, so a field added to
``build_state`` is added to ``_TOP_LEVEL`` or ``_ORDER`` below (or the tests of real states
fail).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastloader.sampling.mix_state import check_mix_state

__all__ = ["MAX_MESSAGE", "validate_state"]

#: The longest message :func:`validate_state` raises.
MAX_MESSAGE = 300
_SHOWN = 60  # the most characters of one value shown in a message

_U64 = 2**64
_I64 = 2**63
_COUNT_MAX = _I64 - 1  # epochs, positions, lengths: anything counted by torch in an int64
_BATCH_MAX = 2**31 - 1  # no loader holds a batch of more samples in memory
_WORLD_MAX = 2**24  # far above any real world size
_TEXT_MAX = 1000  # sampler names are qualified class names


def _show(value: Any) -> str:
    """A short, safe description of any value: never formats a huge one whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (str, bytes)) and len(value) > _SHOWN:
        return f"{type(value).__name__} of {len(value)} characters {value[:20]!r}..."
    if isinstance(value, (dict, list, tuple, set)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    try:
        text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else None
    except Exception:
        text = None
    if text is None:
        text = f"a {type(value).__name__}"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _fail(name: str, problem: str) -> None:
    message = f"bad loader state: {name} {problem}"
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    raise ValueError(message)


def _int(low: int, high: int, none: bool = False) -> Callable[[str, Any], None]:
    """A check that a value is an int (not a bool) in ``[low, high]``, or None if allowed."""

    def check(name: str, value: Any) -> None:
        if value is None and none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            kind = "an int or None" if none else "an int"
            _fail(name, f"must be {kind}, got {_show(value)} ({type(value).__name__})")
        if value < low == 0:
            _fail(name, f"must be non-negative, got {_show(value)}")
        if not low <= value <= high:
            _fail(name, f"must be from {low} to {high}, got {_show(value)}")

    return check


def _bool(none: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is None and none:
            return
        if not isinstance(value, bool):
            kind = "True, False or None" if none else "True or False"
            _fail(name, f"must be {kind}, got {_show(value)} ({type(value).__name__})")

    return check


def _text(choices: tuple[str, ...] | None = None, none: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is None and none:
            return
        if not isinstance(value, str):
            _fail(name, f"must be a str, got {_show(value)} ({type(value).__name__})")
        if len(value) > _TEXT_MAX:
            _fail(name, f"is too long ({len(value)} characters; at most {_TEXT_MAX})")
        if choices is not None and value not in choices:
            _fail(name, f"must be one of {', '.join(map(repr, choices))}, got {_show(value)}")

    return check


_SEED = _int(-_I64, _U64 - 1)  # what torch.manual_seed accepts; fastloader masks to 64 bits
_COUNT = _int(0, _COUNT_MAX)

# Version 1: the position in batches, nothing about the order.
_VERSION_1 = {
    "fastloader_state_version": _int(1, 2),
    "seed": _SEED,
    "epoch": _COUNT,
    "epoch_started": _bool(),
    "epoch_complete": _bool(),
    "batches_consumed": _COUNT,
}
# Version 2 (fastloader/loader/resume.py build_state): optional keys are in _OPTIONAL.
_TOP_LEVEL = {
    **_VERSION_1,
    "position": _COUNT,
    "unit": _text(("samples", "batches")),
    "batch_size": _int(1, _BATCH_MAX, none=True),
    "order": None,  # checked field by field with _ORDER
    "mix": None,  # a Mix's: checked by sampling/mix_state.py check_mix_state
}
_ORDER = {
    "sampler": _text(none=True),
    "dataset_length": _int(0, _COUNT_MAX, none=True),
    "shuffle": _bool(none=True),
    "replacement": _bool(none=True),
    "world_size": _int(1, _WORLD_MAX, none=True),
    "rank": _int(0, _WORLD_MAX - 1, none=True),
    "drop_last": _bool(none=True),
    "epoch_length": _int(0, _COUNT_MAX, none=True),
    "indices_crc": _int(0, 2**32 - 1, none=True),  # zlib.crc32
    "sampler_seed": _int(-_I64, _U64 - 1, none=True),
    "in_order": _bool(),
}
# states written before in_order was recorded lack it; only a loader over a Mix has mix
_OPTIONAL = {"in_order", "mix"}


def _check_fields(what: str, value: Any, fields: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        _fail(what, f"must be a dict, got {_show(value)} ({type(value).__name__})")
    for key in value:
        if not isinstance(key, str):
            _fail(what, f"has a key that is not a str: {_show(key)}")
        if key not in fields:
            _fail(what, f"has an unknown field {_show(key)}")
    prefix = "" if what == "state" else f"{what}."
    for key, check in fields.items():
        if key not in value:
            if key in _OPTIONAL:
                continue
            _fail(f"{prefix}{key}", "is missing")
        if check is not None:
            check(f"{prefix}{key}", value[key])


def _check_consistency(state: dict[str, Any]) -> None:
    version = state["fastloader_state_version"]
    started, complete = state["epoch_started"], state["epoch_complete"]
    position = state.get("position", 0)
    if not started:
        for key in ("position", "batches_consumed"):
            if state.get(key, 0) != 0:
                _fail(key, f"is {state[key]} but epoch_started is False (must be 0)")
        if complete:
            _fail("epoch_complete", "is True but epoch_started is False")
    if version == 1:
        return
    order = state["order"]
    length = order["epoch_length"]
    if length is not None and position > length:
        end = f"the end of the epoch (order.epoch_length {length})"
        _fail("position", f"({position}) is past {end}")
    world, rank = order["world_size"], order["rank"]
    if rank is not None and world is not None and rank >= world:
        _fail("order.rank", f"({rank}) must be below order.world_size ({world})")
    if order["sampler_seed"] is not None and order["sampler_seed"] + state["epoch"] >= _U64:
        # torch's DistributedSampler seeds its generator with seed + epoch
        _fail("order.sampler_seed", "plus epoch must fit in 64 bits")
    batches = state["unit"] == "batches"
    sampler = order["sampler"]
    if sampler is not None and batches != sampler.startswith("batch_sampler "):
        _fail("unit", f"is {state['unit']!r}, which does not match order.sampler {_show(sampler)}")


def validate_state(state: dict) -> None:
    """Check every field of a loader state, and the fields against each other.

    Args:
        state: what ``fastloader.DataLoader.state_dict()`` returned (version 1 or 2), as read
            back from a checkpoint.

    Raises:
        ValueError: naming the first bad field and what is wrong with it, in at most
            :data:`MAX_MESSAGE` characters: not a dict, an unknown version, a missing or unknown
            field, a value of the wrong type, out of range or too long, or fields that
            contradict each other (see NOTE [ Validating a loader state ]).
    """
    if not isinstance(state, dict) or "fastloader_state_version" not in state:
        raise ValueError(
            "load_state_dict expects a dict made by fastloader.DataLoader.state_dict()"
        )
    version = state["fastloader_state_version"]
    if isinstance(version, bool) or version not in (1, 2):
        raise ValueError(
            f"unsupported fastloader state version {_show(version)}: this fastloader reads "
            "versions 1 and 2"
        )
    _check_fields("state", state, _VERSION_1 if version == 1 else _TOP_LEVEL)
    if version == 2:
        _check_fields("order", state["order"], _ORDER)
        if "mix" in state:
            check_mix_state(state["mix"])
    _check_consistency(state)
