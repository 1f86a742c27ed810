"""Loader states: what decides the order, where the epoch is, and whether a resume is exact.

NOTE [ Resume is exact or refused ]

A state (version 2) holds the epoch, the seed and the position in the epoch *in samples* of the
epoch's order (global samples with ``distributed=True``; see NOTE [ Global order ] in
``distributed.py``), plus a description of that order: the sampler kind, the dataset length,
shuffle, drop_last, the world size and batch size. Because the order depends only on
``(seed, epoch)``, a loader with another ``batch_size``, ``num_workers`` or (with
``distributed=True``) world size continues at exactly the next unseen sample.

``load_state_dict`` compares the description with the loading loader's when the state is in
the middle of an epoch, and raises ValueError naming the first field that differs: resuming
there would lose or repeat samples. At an epoch boundary nothing is lost, so only the seed and
the epoch are taken. What cannot be compared is refused too: a sampler whose order is not a
function of the epoch (torch's RandomSampler, WeightedRandomSampler), or an iterable dataset,
in the middle of an epoch. A batch sampler of the user's is resumed in batches (its batches
cannot be re-cut), so its length must match.

Only the end of a resumed epoch can differ from an uninterrupted one, and only when the step
changed: with ``drop_last`` the resumed epoch drops ``(remaining) % step`` samples instead of
``length % step``, and with ``distributed=True, shuffle=True`` a short last step may be padded
differently. ``load_state_dict`` warns, with the numbers, when that happens.

NOTE [ Out of order ]: with ``in_order=False`` and worker processes, batches are handed out
as they finish, so "batches consumed x batch size" is not a prefix of the order. The state
records ``order["in_order"]`` (False only then; a version-2 state without it was in order),
and a mid-epoch resume of such a state is refused: ``state_dict`` itself never raises, as
Lightning calls it on every checkpoint, and an epoch-boundary state resumes as usual.

Version-1 states (position in batches, nothing about the order) are still read: at an epoch
boundary exactly; mid-epoch assuming the same batch size and dataset (with a warning), and
refused for ``distributed=True``, whose order was per rank in version 1.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from fastloader.loader.state_checks import validate_state as check_state_fields
from fastloader.sampling.distributed import ElasticDistributedSampler
from fastloader.sampling.mix_samplers import ElasticMixSampler, MixSampler
from fastloader.sampling.samplers import BlockShuffleSampler, EpochShuffleSampler

MIX_SAMPLERS = (MixSampler, ElasticMixSampler)

STATE_VERSION = 2

# Fields compared mid-epoch, in the order they are reported.
_ORDER_FIELDS = (
    "sampler",
    "dataset_length",
    "shuffle",
    "replacement",
    "world_size",
    "rank",
    "drop_last",
    "epoch_length",
    "indices_crc",
)
_FIELD_NAMES = {
    "sampler": "sampler kind",
    "dataset_length": "dataset length",
    "epoch_length": "samples per epoch",
    "indices_crc": "sampler indices",
    "drop_last": "drop_last",
}


def _qualname(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _dataset_length(loader: Any) -> int | None:
    if isinstance(loader.dataset, IterableDataset):
        return None
    try:
        return len(loader.dataset)
    except TypeError:
        return None


def describe_order(loader: Any) -> dict[str, Any]:
    """What decides the loader's order, and how a position in it is counted.

    Keys: the ``_ORDER_FIELDS`` (None where they do not apply), ``unit`` ("samples" or
    "batches"), ``step`` (units per batch this process takes), ``exact`` (whether a
    mid-epoch position can be resumed), ``batch_size`` and ``sampler_seed``.
    """
    description: dict[str, Any] = dict.fromkeys(_ORDER_FIELDS)
    description.update(
        dataset_length=_dataset_length(loader),
        drop_last=bool(loader.drop_last),
        batch_size=loader.batch_size,
        world_size=1,
        unit="samples",
        step=loader.batch_size or 1,
        exact=True,
        sampler_seed=None,
    )
    if isinstance(loader.dataset, IterableDataset):
        description.update(sampler="iterable dataset", exact=False)
        return description
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        description.update(
            sampler=f"batch_sampler {_qualname(batch_sampler)}",
            unit="batches",
            step=1,
            epoch_length=_length(batch_sampler),
            exact=callable(getattr(batch_sampler, "set_epoch", None)),
            drop_last=None,
        )
        return description
    sampler = loader.sampler
    description["epoch_length"] = _length(sampler)
    description.update(_sampler_fields(loader, sampler))
    return description


def _sampler_fields(loader: Any, sampler: Any) -> dict[str, Any]:
    """The fields of ``describe_order`` that the loader's sampler decides."""
    if isinstance(sampler, MIX_SAMPLERS):  # a Mix: one global order (sampling/mix_order.py)
        elastic = isinstance(sampler, ElasticDistributedSampler)
        return dict(
            sampler="mix",
            replacement=False,
            epoch_length=len(loader.dataset),
            world_size=sampler.num_replicas if elastic else 1,
            step=sampler.global_batch if elastic else (loader.batch_size or 1),
        )
    if isinstance(sampler, ElasticDistributedSampler):
        return dict(  # a shard-aware order names its shape (sampling/shard_order.py)
            sampler=getattr(sampler, "order_name", "shuffle" if sampler.shuffle else "sequential"),
            shuffle=sampler.shuffle,
            replacement=False,
            epoch_length=sampler.dataset_length,
            world_size=sampler.num_replicas,
            step=sampler.global_batch,
            sampler_seed=sampler.seed,
        )
    if isinstance(sampler, BlockShuffleSampler):
        return dict(
            sampler=f"blocks {sampler.block_size}x{sampler.window}",
            shuffle=True,
            replacement=False,
            sampler_seed=sampler.seed,
        )
    if isinstance(sampler, EpochShuffleSampler):
        return dict(
            sampler="shuffle",
            shuffle=True,
            replacement=sampler.replacement,
            sampler_seed=sampler.seed,
        )
    if isinstance(sampler, DistributedSampler):
        return dict(
            sampler="torch DistributedSampler (per-rank order)",
            shuffle=sampler.shuffle,
            world_size=sampler.num_replicas,
            rank=sampler.rank,
            sampler_seed=sampler.seed,
        )
    return _plain_sampler_fields(sampler)


def _plain_sampler_fields(sampler: Any) -> dict[str, Any]:
    """``_sampler_fields`` of a sampler that is none of fastloader's or torch's distributed."""
    if type(sampler) is SequentialSampler:
        return dict(sampler="sequential", shuffle=False, replacement=False)
    if isinstance(sampler, (list, tuple, range)):
        crc = zlib.crc32(repr(sampler if isinstance(sampler, range) else list(sampler)).encode())
        return dict(sampler="indices", indices_crc=crc)
    # torch's RandomSampler (unless ours) and WeightedRandomSampler draw from hidden RNG
    # state; a sampler with set_epoch is taken to depend only on the epoch, as for prefetch.
    return dict(
        sampler=_qualname(sampler),
        shuffle=True if isinstance(sampler, RandomSampler) else None,
        exact=callable(getattr(sampler, "set_epoch", None)),
    )


def _length(sized: Any) -> int | None:
    try:
        return len(sized)
    except TypeError:
        return None


def build_state(loader: Any, cursor: Any) -> dict[str, Any]:
    """The state of ``loader``, whose ``cursor`` (NOTE [ The epoch cursor ] in loader/cursor.py)
    says where it is: JSON-able, its size O(1) in the dataset size (building it is O(1) too,
    except for a list or tuple of indices as the sampler, which is hashed: O(its length))."""
    description = describe_order(loader)
    started = cursor.started
    position = cursor.position(description["step"], description["epoch_length"])
    order = {key: description[key] for key in _ORDER_FIELDS}
    order.update(sampler_seed=description["sampler_seed"], in_order=_delivered_in_order(loader))
    return {
        "fastloader_state_version": STATE_VERSION,
        "seed": loader.seed,
        "epoch": cursor.epoch,
        "epoch_started": started,
        "epoch_complete": cursor.complete,
        "position": position,
        "unit": description["unit"],
        "batches_consumed": cursor.consumed if started else 0,
        "batch_size": description["batch_size"],
        "order": order,
    } | ({"mix": loader.dataset.state_dict()} if isinstance(loader.sampler, MIX_SAMPLERS) else {})


def _delivered_in_order(loader: Any) -> bool:
    """Whether batches reach the user in the order's sequence (see NOTE [ Out of order ])."""
    return bool(getattr(loader, "in_order", True)) or not loader.num_workers


def _check_type(state: dict[str, Any], key: str, kind: type, allow_none: bool = False) -> None:
    value = state.get(key)
    if value is None and allow_none:
        return
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"state[{key!r}] must be an int, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"state[{key!r}] must be a {kind.__name__}, got {value!r}")


def validate_state(state: Any) -> None:
    """Check the shape of a state (any version this code reads).

    Raises:
        ValueError: naming the malformed field, or for an unknown version.
    """
    check_state_fields(state)  # every field's type, range and size first (loader/state_checks.py)
    if not isinstance(state, dict) or "fastloader_state_version" not in state:
        raise ValueError(
            "load_state_dict expects a dict made by fastloader.DataLoader.state_dict()"
        )
    version = state["fastloader_state_version"]
    if version not in (1, STATE_VERSION):
        raise ValueError(
            f"unsupported fastloader state version {version!r}: this fastloader reads versions "
            f"1 and {STATE_VERSION}"
        )
    counters = ("seed", "epoch", "batches_consumed")
    if version == STATE_VERSION:
        counters += ("position",)
    for key in counters:
        _check_type(state, key, int)
    for key in ("epoch", "batches_consumed", "position"):
        if state.get(key, 0) < 0:
            raise ValueError(f"state[{key!r}] must be non-negative, got {state[key]}")
    for key in ("epoch_started", "epoch_complete"):
        _check_type(state, key, bool)
    if version == STATE_VERSION:
        unit = state.get("unit")
        if unit not in ("samples", "batches"):
            raise ValueError(f"state['unit'] must be 'samples' or 'batches', got {unit!r}")
        _check_type(state, "order", dict)
        _check_type(state, "batch_size", int, allow_none=True)


def resume_point(state: dict[str, Any], loader: Any) -> tuple[int, int]:
    """Where ``loader`` continues from ``state``: (epoch, position in the loader's unit).

    Raises:
        ValueError: when the position cannot be resumed exactly, naming what differs.
    """
    validate_state(state)
    epoch = state["epoch"]
    if not state["epoch_started"]:
        return epoch, 0
    if state["epoch_complete"]:
        return epoch + 1, 0
    here = describe_order(loader)
    if state["fastloader_state_version"] == 1:
        position = _legacy_position(state, loader, here)
    else:
        position = state["position"]
        if position == 0:
            return epoch, 0
        _check_delivered_in_order(state, here, position)
        _check_same_order(state, here)
    length = here["epoch_length"]
    if length is not None and position > length:
        raise ValueError(
            f"cannot resume: the state's position ({position} {here['unit']}) is past the end "
            f"of the epoch ({length} {here['unit']} in this loader)"
        )
    if state["fastloader_state_version"] == STATE_VERSION:
        _warn_if_the_end_differs(state, here, position)
    return epoch, position


def _legacy_position(state: dict[str, Any], loader: Any, here: dict[str, Any]) -> int:
    consumed = state["batches_consumed"]
    if consumed == 0:
        return 0
    if not here["exact"] or isinstance(loader.sampler, ElasticDistributedSampler):
        raise ValueError(
            "cannot resume a version-1 state from the middle of an epoch with this loader "
            f"({here['sampler']}): version 1 did not record the order (distributed=True was "
            "ordered per rank then); resume from an epoch boundary instead"
        )
    warnings.warn(
        "a version-1 fastloader state records only batches consumed: resuming after "
        f"{consumed} batches assumes the same batch_size, dataset and sampler as when it was "
        "saved",
        UserWarning,
        stacklevel=4,
    )
    return consumed * (1 if here["unit"] == "batches" else (here["batch_size"] or 1))


def _check_delivered_in_order(state: dict[str, Any], here: dict[str, Any], position: int) -> None:
    if state["order"].get("in_order") is not False:
        return  # in order, or a state from before in_order was recorded
    length = here["epoch_length"]
    if length is not None and position >= length:
        return  # every batch of the epoch was consumed: nothing to lose or repeat
    raise ValueError(
        "cannot resume exactly from the middle of an epoch: the state was taken with "
        "in_order=False (and worker processes), so its batches were delivered as they "
        "finished loading and the batches consumed are not the first "
        f"{position} {state['unit']} of the epoch's order, and resuming there would skip some "
        "samples and repeat others. States taken at an epoch boundary resume fine; use "
        "in_order=True for checkpoints in the middle of an epoch"
    )


def _check_same_order(state: dict[str, Any], here: dict[str, Any]) -> None:
    if not here["exact"]:
        raise ValueError(
            f"cannot resume in the middle of an epoch with {here['sampler']}: its order is not "
            "a function of (seed, epoch). Use shuffle=True (fastloader's seeded order), or "
            "resume from a state taken at an epoch boundary"
        )
    saved = state["order"]
    if state["unit"] != here["unit"]:
        raise ValueError(
            f"cannot resume exactly: position unit differs (state: {state['unit']}, this "
            f"loader: {here['unit']}; sampler kind: {saved.get('sampler')!r} vs "
            f"{here['sampler']!r})"
        )
    elastic = here["sampler"] in ("shuffle", "sequential", "mix") or str(
        here["sampler"]
    ).startswith("shards ")  # the shard-aware order: global too (sampling/shard_order.py)
    for field in _ORDER_FIELDS:
        if field == "world_size" and elastic:
            continue  # the global order does not depend on the world size
        if field == "rank":
            # ranks in step have taken the same number of samples of their own order, so
            # any rank's state resumes every rank (Lightning saves rank 0's)
            continue
        if saved.get(field) != here[field]:
            name = _FIELD_NAMES.get(field, field.replace("_", " "))
            hint = ""
            if field == "world_size":
                hint = (
                    ": torch's DistributedSampler orders each rank's samples by world size; "
                    "use DataLoader(distributed=True) for an order that resumes on any world size"
                )
            raise ValueError(
                f"cannot resume exactly: {name} differs (state: {saved.get(field)!r}, this "
                f"loader: {here[field]!r}){hint}"
            )


def _tail(remaining: int, step: int, world_size: int, drop_last: bool, pad_short: bool) -> str:
    short = remaining % step if step else 0
    if not short:
        return "drops and repeats nothing"
    if drop_last:
        return f"drops its last {short} samples"
    if pad_short and short < world_size:
        return f"repeats {world_size - short} samples to pad its last step"
    return "drops and repeats nothing"


def _warn_if_the_end_differs(state: dict[str, Any], here: dict[str, Any], position: int) -> None:
    saved = state["order"]
    length = here["epoch_length"]
    if here["unit"] != "samples" or length is None or saved.get("drop_last") is None:
        return
    shuffled = here["sampler"] == "shuffle"
    saved_world = saved.get("world_size") or 1
    global_order = here["sampler"] in ("shuffle", "sequential", "mix")
    saved_step = (state.get("batch_size") or 1) * (saved_world if global_order else 1)
    before = _tail(length, saved_step, saved_world, here["drop_last"], shuffled)
    after = _tail(length - position, here["step"], here["world_size"], here["drop_last"], shuffled)
    if before != after:
        warnings.warn(
            f"resumed with {here['step']} samples per step instead of {saved_step}: the rest of "
            f"epoch {state['epoch']} {after}, where the interrupted run's epoch {before}; "
            "every other sample of the epoch is seen exactly once",
            UserWarning,
            stacklevel=4,
        )
