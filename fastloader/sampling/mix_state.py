"""A mix's part of a loader state: built, checked field by field, and merged on resume.

Runs in the main process (``state_dict`` / ``load_state_dict``).

NOTE [ Resuming a mix whose sources changed ]

The state's ``mix`` holds what decides the order (seed, policy, interleave, shuffle, samples
per epoch), the sources by name with their sizes, and the weight history: O(sources x
weight changes), about 1 KB for 16 sources. On resume at stream position ``P``:

- policy, interleave, shuffle and samples per epoch must be the state's, or the resume is
  refused naming the field; the seed is the state's (as the loader's is).
- A source whose size changed is refused by name: its shuffled epochs would be other
  permutations, so the samples still due from it are unknown.
- The weights before ``P`` are the state's: they decided the draws made so far. The Mix's own
  plan (its weights and schedule) must agree with them before ``P``, or the resume is refused
  naming the position; the plan's entries from ``P`` on (a schedule extended since) apply.
  Changes made by ``set_weights`` are in the state and kept.
- Sources added or removed (matched by name; the order of the dict never matters) are refused
  by name unless the Mix was made with ``on_change="reweight"``. Then, for the endless
  policies, the mix continues at ``P`` with the Mix's own weights (and its schedule after
  ``P``): a removed source stops being drawn, an added one starts its first epoch, and every
  other source continues exactly where its draws stopped (its count before ``P`` comes from the
  recorded history, removed sources included). The state records the change as a weight
  change at ``P``, so a later resume repeats it.
"""

from __future__ import annotations

from typing import Any

from fastloader.sampling.interleave import as_weight
from fastloader.sampling.mix_order import ENDLESS, INTERLEAVES, POLICIES

__all__ = ["HOW", "build_mix_state", "check_mix_state", "merge_history"]

HOW = ("init", "schedule", "call", "resume")  # what made each weight segment
_MAX_SOURCES = 4096
_MAX_SEGMENTS = 10_000
_MAX_NAME = 200
_MAX_COUNT = 2**62
_FIELDS = ("seed", "policy", "interleave", "shuffle", "samples_per_epoch", "sources", "weights")

History = list[tuple[int, dict[str, float], str]]


def build_mix_state(mix: Any) -> dict[str, Any]:
    """The mix's state: JSON-able, O(sources x weight segments)."""
    order = mix.order
    return {
        "seed": order.seed,
        "policy": order.policy,
        "interleave": order.interleave,
        "shuffle": order.shuffle,
        "samples_per_epoch": order.epoch_length,
        "sources": dict(mix.sizes),
        "weights": [[start, how, dict(weights)] for start, weights, how in mix.history],
    }


def _fail(name: str, problem: str) -> None:
    raise ValueError(f"bad loader state: {name} {problem}"[:300])


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_name(field: str, name: Any) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
        _fail(field, f"has a source name that is not a str of 1 to {_MAX_NAME} characters")


def _check_segment(j: int, segment: Any, previous: int) -> int:
    field = f"mix.weights[{j}]"
    if not isinstance(segment, list) or len(segment) != 3:
        _fail(field, "must be a list [start, how, {name: weight}]")
    start, how, weights = segment
    if not _is_int(start, 0, _MAX_COUNT) or (j == 0) != (start == 0) or start <= previous:
        _fail(f"{field}[0]", "must be a position, 0 first, then strictly increasing")
    if how not in HOW:
        _fail(f"{field}[1]", f"must be one of {', '.join(HOW)}")
    if not isinstance(weights, dict) or not 0 < len(weights) <= _MAX_SOURCES:
        _fail(f"{field}[2]", "must be a dict of source name -> weight")
    for name, weight in weights.items():
        _check_name(f"{field}[2]", name)
        if as_weight(weight) is None:
            _fail(f"{field}[2][{name[:40]!r}]", "must be a finite non-negative number")
    if not any(weights.values()):
        _fail(f"{field}[2]", "must give at least one source a positive weight")
    return start


def check_mix_state(mix: Any) -> None:
    """Check the ``mix`` field of a loader state.

    Raises:
        ValueError: naming the first malformed field.
    """
    if not isinstance(mix, dict):
        _fail("mix", "must be a dict")
    for key in mix:
        if key not in _FIELDS:
            _fail("mix", f"has an unknown field {str(key)[:40]!r}")
    for key in _FIELDS:
        if key not in mix:
            _fail(f"mix.{key}", "is missing")
    _check_settings_fields(mix)
    _check_sources_field(mix["sources"])
    segments = mix["weights"]
    if not isinstance(segments, list) or not 0 < len(segments) <= _MAX_SEGMENTS:
        _fail("mix.weights", f"must be a list of 1 to {_MAX_SEGMENTS} weight segments")
    previous = -1
    for j, segment in enumerate(segments):
        previous = _check_segment(j, segment, previous)


def _check_settings_fields(mix: dict[str, Any]) -> None:
    if not _is_int(mix["seed"], -(2**63), 2**64 - 1):
        _fail("mix.seed", "must be an int of at most 64 bits")
    if mix["policy"] not in POLICIES:
        _fail("mix.policy", f"must be one of {', '.join(POLICIES)}")
    if mix["interleave"] not in INTERLEAVES:
        _fail("mix.interleave", f"must be one of {', '.join(INTERLEAVES)}")
    if not isinstance(mix["shuffle"], bool):
        _fail("mix.shuffle", "must be a bool")
    if not _is_int(mix["samples_per_epoch"], 1, _MAX_COUNT):
        _fail("mix.samples_per_epoch", "must be a positive int")


def _check_sources_field(sources: Any) -> None:
    if not isinstance(sources, dict) or not 0 < len(sources) <= _MAX_SOURCES:
        _fail("mix.sources", f"must be a dict of 1 to {_MAX_SOURCES} source name -> size")
    for name, size in sources.items():
        _check_name("mix.sources", name)
        if not _is_int(size, 1, _MAX_COUNT):
            _fail(f"mix.sources[{name[:40]!r}]", "must be a positive int (the source's size)")


def _refuse(problem: str) -> None:
    raise ValueError(f"cannot resume this Mix exactly: {problem}")


def _check_settings(mix: Any, saved: dict[str, Any]) -> None:
    order = mix.order
    here = {
        "policy": order.policy,
        "interleave": order.interleave,
        "shuffle": order.shuffle,
        "samples_per_epoch": order.epoch_length,
    }
    for key, value in here.items():
        if saved[key] != value:
            hint = " (pass samples_per_epoch= to keep it)" if key == "samples_per_epoch" else ""
            _refuse(f"mix.{key} differs (state: {saved[key]!r}, this Mix: {value!r}){hint}")


def _check_sources(mix: Any, saved: dict[str, Any]) -> bool:
    """Whether sources were added or removed (allowed by the caller's rule); sizes must match."""
    here = mix.sizes
    for name in sorted(set(here) & set(saved["sources"])):
        if here[name] != saved["sources"][name]:
            _refuse(
                f"source {name!r} has {here[name]} samples, the state's had "
                f"{saved['sources'][name]} (mix.sources): its shuffled epochs would differ"
            )
    removed = sorted(set(saved["sources"]) - set(here))
    added = sorted(set(here) - set(saved["sources"]))
    if not (removed or added):
        return False
    what = "; ".join(
        [f"source {name!r} is in the state but not in this Mix" for name in removed]
        + [f"source {name!r} is in this Mix but not in the state" for name in added]
    )
    if mix.on_change != "reweight":
        _refuse(
            f"{what} (mix.sources). Pass Mix(..., on_change='reweight') to continue with this "
            "Mix's sources and weights from the resume position"
        )
    if saved["policy"] not in ENDLESS:
        _refuse(f"{what} (mix.sources), and policy {saved['policy']!r} cannot change weights")
    return True


def merge_history(mix: Any, saved: dict[str, Any], position: int) -> History:
    """The weight history a Mix continues with from ``saved`` at stream ``position``.

    See NOTE [ Resuming a mix whose sources changed ].

    Raises:
        ValueError: naming the field or source that makes an exact resume impossible.
    """
    changed = _check_sources(mix, saved)  # by name first: the clearest message
    _check_settings(mix, saved)
    past = _saved_past(saved, position)
    if changed:
        future = [(s, w, h) for s, w, h in mix.plan if s > position]
        return [*past, (position, dict(mix.plan[0][1]), "resume"), *future]
    _check_plan_agrees(mix, saved, position)
    taken = {start for start, _, _ in past}  # a set_weights call wins over the plan
    future = [(s, w, h) for s, w, h in mix.plan if s >= position and s not in taken]
    return sorted([*past, *future], key=lambda entry: entry[0])


def _saved_past(saved: dict[str, Any], position: int) -> History:
    """The state's segments that stay: those before ``position``, and every call or resume."""
    return [
        (start, dict(weights), how)
        for start, how, weights in saved["weights"]
        if start < position or how in ("call", "resume")
    ]


def _check_plan_agrees(mix: Any, saved: dict[str, Any], position: int) -> None:
    """Refuse unless the Mix's plan gives the state's weights before ``position``."""
    # the Mix's plan took over at the last reweighted resume (or at 0): compare from there
    took_over = max([s for s, h, _ in saved["weights"] if h == "resume" and s <= position] or [0])
    planned_before = _planned_before(mix, saved, took_over, position)
    saved_before = [
        (s, w)
        for s, h, w in saved["weights"]
        if took_over <= s < position and h in ("init", "schedule", "resume")
    ]
    for (start, theirs), (_, ours) in zip(saved_before, planned_before, strict=False):
        if theirs != ours:
            _refuse(
                f"mix.weights differ at position {start} (state: {_short(theirs)}, this Mix: "
                f"{_short(ours)}); the draws made so far depend on them"
            )
    if len(saved_before) != len(planned_before):
        _refuse(
            f"mix.weights: the state's schedule before position {position} changes weights at "
            f"{[s for s, _ in saved_before][:5]}, this Mix's at "
            f"{[s for s, _ in planned_before][:5]}"
        )


def _planned_before(
    mix: Any, saved: dict[str, Any], took_over: int, position: int
) -> list[tuple[int, dict[str, float]]]:
    """The Mix's plan from ``took_over`` to ``position``, less the positions a call replaced."""
    plan = [(took_over, mix.plan[0][1])] + [(s, w) for s, w, _ in mix.plan[1:] if s > took_over]
    called = {s for s, h, _ in saved["weights"] if h == "call"}  # a call replaced the plan there
    return [(s, w) for s, w in plan if s < position and s not in called]


def _short(weights: dict[str, float]) -> str:
    text = ", ".join(f"{name!r}: {w:g}" for name, w in sorted(weights.items()))
    return "{" + (text if len(text) < 80 else text[:77] + "...") + "}"
