"""``Mix``: several named map-style datasets read as one, by weight, in a resumable order.

The dataset runs where samples are loaded (workers); its order (``order``, a ``MixOrder``)
and weight changes run in the main process, in the samplers (mix_samplers.py) and the loader.

NOTE [ Weight changes ]

Weights change in two ways, both recorded as segments ``(start, weights)`` of the history
(NOTE [ The mixed order as a pure function ] in mix_order.py), so a rerun or a resume gives
the same order:

- a **schedule**, ``Mix(..., schedule={position: weights})``, known from the start: positions
  are samples of the mixed stream (``step * global batch size`` for a schedule by step), the
  same at any world size, worker count or batch size;
- a **call**, ``mix.set_weights(weights)``, which takes effect at the next sample the training
  loop has not seen: the loader's position (NOTE [ The epoch cursor ]), in global samples.
  Batches already loaded ahead (by workers, or by the schedule's look-ahead) were drawn with
  the old weights, so the loader drops them and loads again from that position with the new
  weights (the replan hook the loader hands to ``attach``: the workers stay, in-flight
  batches are drained, as after ``set_epoch``). Every rank makes the same call at the same
  step, so every rank changes at the same global position. A schedule entry after the call
  still applies; a call at a scheduled position replaces it.

Every weight change is checked as the first weights are (NOTE [ Weights that overflow or
vanish ] in interleave.py): a weight no float holds or too small for its share is refused by
name, a sum that overflows keeps its proportions.

Weights are only changed for the endless policies ("cycle", "replacement"): with the others
an epoch's length follows from the weights.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from torch.utils.data import Dataset, IterableDataset

from fastloader.sampling.interleave import RESOLUTION, as_weight, below_resolution
from fastloader.sampling.mix_order import ENDLESS, INTERLEAVES, POLICIES, MixOrder
from fastloader.sampling.mix_samplers import ElasticMixSampler, MixSampler
from fastloader.sampling.mix_state import build_mix_state, merge_history

__all__ = ["Mix", "MixSample", "mix_sampler"]


_new_tuple = tuple.__new__


class MixSample(NamedTuple):
    """A sample of a ``Mix``: the source's sample, the source's name, and the index there.

    torch's and fastloader's default collate turn a batch of them into one ``MixSample`` of
    ``sample`` (the collated samples), ``source`` (a tuple of names) and ``index`` (an int64
    tensor). The sample comes first, so that code looking for a batch's first tensor (the
    loader's stats) finds the sample's, as without a mix.
    """

    sample: Any
    source: str
    index: int


def _check_weights(weights: Any, names: list[str], what: str) -> dict[str, float]:
    if not isinstance(weights, Mapping):
        raise TypeError(f"{what} must be a dict of source name -> weight, got {weights!r}")
    unknown = sorted(set(map(str, weights)) - set(names))
    if unknown:
        raise ValueError(f"{what} names unknown sources {unknown} (sources: {sorted(names)})")
    missing = sorted(set(names) - set(weights))
    if missing:
        raise ValueError(f"{what} must give every source a weight; missing: {missing}")
    checked = {}
    for name in sorted(names):
        weight = as_weight(weights[name])
        if weight is None:
            raise ValueError(
                f"{what}[{name!r}] must be a finite number >= 0 that fits a float (at most "
                f"{sys.float_info.max:.4g}), got {_short_repr(weights[name])}"
            )
        checked[name] = weight
    if not any(checked.values()):
        raise ValueError(f"{what} must give at least one source a positive weight")
    _check_resolution(checked, what)
    return checked


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _check_resolution(weights: dict[str, float], what: str) -> None:
    """Refuse weights too small for their share (NOTE [ Weights that overflow or vanish ])."""
    names = list(weights)
    small = below_resolution([weights[name] for name in names])
    if small:
        listed = ", ".join(f"{what}[{names[s]!r}] ({share:.3g} of the total)" for s, share in small)
        raise ValueError(
            f"{listed}: below the mix's resolution; such a source would be drawn at "
            f"{RESOLUTION:.3g} of the samples (one part in {round(1 / RESOLUTION)}), over twice "
            f"its weight. Give it weight 0 or at least {RESOLUTION / 2:.3g} of the total"
        )


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_sources(sources: Any) -> dict[str, Any]:
    """The sources by name, sorted (the dict's order never matters)."""
    if not isinstance(sources, Mapping) or not sources:
        raise ValueError("sources must be a non-empty dict of name -> dataset")
    datasets = {}
    for name in sorted(sources):
        dataset = sources[name]
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ValueError(f"source names must be str of 1 to 200 characters: {name!r}")
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(f"source {name!r} must be a map-style dataset with __len__")
        if len(dataset) < 1:
            raise ValueError(f"source {name!r} is empty")
        datasets[name] = dataset
    return datasets


def _check_settings(
    policy: str, interleave: str, on_change: str, samples_per_epoch: int | None
) -> None:
    _check_choice("policy", policy, POLICIES)
    _check_choice("interleave", interleave, INTERLEAVES)
    _check_choice("on_change", on_change, ("refuse", "reweight"))
    if interleave == "iid" and policy != "replacement":
        raise ValueError('interleave="iid" needs policy="replacement" (see mix_order.py)')
    if samples_per_epoch is not None and (
        isinstance(samples_per_epoch, bool)
        or not isinstance(samples_per_epoch, int)
        or samples_per_epoch < 1
    ):
        raise ValueError(f"samples_per_epoch must be a positive int: {samples_per_epoch!r}")


def _weight_plan(weights: Any, schedule: Any, sizes: dict[str, int]) -> list[Any]:
    """``[(start, weights, how)]``: the weights at 0 (default: the sizes) and the schedule's."""
    names = list(sizes)
    if weights is None:
        initial = _check_weights(
            {name: float(size) for name, size in sizes.items()},
            names,
            "weights (by default the sources' sizes)",
        )
    else:
        initial = _check_weights(weights, names, "weights")
    plan = [(0, initial, "init")]
    for at in sorted(schedule or {}):
        if isinstance(at, bool) or not isinstance(at, int) or at < 1:
            raise ValueError(f"schedule positions must be ints >= 1, got {at!r}")
        plan.append((at, _check_weights(schedule[at], names, f"schedule[{at}]"), "schedule"))
    return plan


class Mix(Dataset):
    """Map-style datasets read as one by weight: ``Mix({"web": a, "code": b}, {"web": .7,
    "code": .3})``.

    Item ``i`` of the loader's order is a ``MixSample(sample, source, index)`` (or the bare
    sample with ``with_source=False``). The order is a pure function of (seed, position):
    each source is read in shuffled epochs of its own, and by default every window of ``N``
    samples holds each source's share ``w N`` to within about 2 samples, almost always
    ``floor`` or ``ceil`` of it (NOTE [ The interleave ]). ``fastloader.DataLoader`` reads it
    in that order (any ``shuffle``), with per-sample seeding, and resumes it exactly with
    another world size, worker count or batch size (``loader.state_dict()`` carries the mix).

    Args:
        sources: name -> map-style dataset (a pack, a user's HDF5/LMDB file, any Dataset with
            ``__len__``). Names identify sources on resume; the dict's order does not matter.
        weights: name -> non-negative weight for every source (any scale, even one whose
            sum overflows; a positive weight must be at least 2**-21 of the total, see NOTE
            [ Weights that overflow or vanish ] in interleave.py). Default: the sources'
            sizes (a shuffled concatenation, interleaved).
        policy: "cycle" (default: endless, sources reshuffled as they run out), "replacement"
            (endless, uniform draws), "first_exhausted" / "all_exhausted" (an epoch ends with
            the first / last source's last sample), "once" (every sample once per epoch,
            source after source: evaluation). See NOTE [ The mixed order as a pure function ].
        interleave: "smooth" (deterministic, proportions in every window) or "iid" (each
            sample's source drawn at random by weight; with ``policy="replacement"`` only).
        shuffle: shuffle each source's epochs (False: index order, e.g. for evaluation).
        samples_per_epoch: the loader's epoch for the endless policies (default: the sum of
            the sources' sizes).
        schedule: ``{position: weights}``: weights from that sample of the mixed stream on
            (``step * global batch size`` for a schedule by step). See NOTE [ Weight changes ].
        seed: the order's seed; None takes the loader's ``seed``.
        with_source: yield ``MixSample``s (default) or the bare samples.
        on_change: on resume, sources added or removed are "refuse"d (default) or continue
            with this Mix's weights ("reweight"). See NOTE [ Resuming a mix whose sources
            changed ].

    Raises:
        ValueError, TypeError: for an empty or unnamed source, an iterable dataset, bad
            weights (naming the source: not a finite float, or too small for its share), or
            an unknown policy.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | None = None,
        *,
        policy: str = "cycle",
        interleave: str = "smooth",
        shuffle: bool = True,
        samples_per_epoch: int | None = None,
        schedule: Mapping[int, Mapping[str, float]] | None = None,
        seed: int | None = None,
        with_source: bool = True,
        on_change: str = "refuse",
    ) -> None:
        self.datasets = _check_sources(sources)
        self.sizes = {name: len(dataset) for name, dataset in self.datasets.items()}
        _check_settings(policy, interleave, on_change, samples_per_epoch)
        plan = _weight_plan(weights, schedule, self.sizes)
        if len(plan) > 1 and policy not in ENDLESS:
            raise ValueError(f"policy {policy!r} cannot change weights: use 'cycle'")
        self.plan = plan
        self.history = list(plan)
        self.policy, self.interleave, self.shuffle = policy, interleave, bool(shuffle)
        self.samples_per_epoch = samples_per_epoch
        self.seed = seed
        self.with_source = with_source
        self.on_change = on_change
        self._order_seed = 0 if seed is None else seed
        self._loader: Any = None
        self._rebuild()

    def _rebuild(self) -> None:
        sizes = dict(self.sizes)
        for _, weights, _ in self.history:  # sources removed on a reweighted resume: size 0
            sizes.update({name: 0 for name in weights if name not in sizes})
        self.order = MixOrder(
            sizes,
            [(start, weights) for start, weights, _ in self.history],
            self._order_seed,
            self.policy,
            self.interleave,
            self.shuffle,
            self.samples_per_epoch,
        )
        # what __getitem__ needs, as plain lists (a bisection in a worker costs ~0.2 us)
        order = self.order
        kept = [s for s, size in enumerate(order.sizes) if size]  # removed sources: size 0
        self._decoder = (
            order.total,
            [int(order.offsets[s]) for s in kept],
            [order.names[s] for s in kept],
            [self.datasets[order.names[s]] for s in kept],
        )

    # -- what workers call ------------------------------------------------------------------

    def __len__(self) -> int:
        """Samples per epoch of the loader."""
        return self.order.epoch_length

    def __getitem__(self, code: int) -> Any:
        """The sample of a code from the mix's samplers (NOTE [ The mixed order as a pure
        function ]): a ``MixSample`` (or the bare sample with ``with_source=False``)."""
        total, starts, names, datasets = self._decoder
        rest = code % total
        s = bisect.bisect_right(starts, rest) - 1
        index = rest - starts[s]
        if self.with_source:  # MixSample(...) without its Python-level __new__: ~0.2 us less
            return _new_tuple(MixSample, (datasets[s][index], names[s], index))
        return datasets[s][index]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loader"] = None  # weak references to the main process's loader
        return state

    # -- the main process --------------------------------------------------------------------

    def use_seed(self, seed: int) -> None:
        """Take the order's seed (the loader's, when the Mix was made with ``seed=None``)."""
        self._order_seed = int(seed)
        self._rebuild()

    def attach(self, seed: int, next_unseen: Callable[[], int], replan: Callable[[], None]) -> None:
        """Called by ``fastloader.DataLoader`` with two of its own methods: weight changes
        take effect at ``next_unseen()`` (the loader's next unseen position) and then call
        ``replan()`` (the loader loads again from there). Both are held weakly."""
        self._loader = (weakref.WeakMethod(next_unseen), weakref.WeakMethod(replan))
        if self.seed is None:
            self.use_seed(seed)

    def _loader_hooks(self) -> tuple[Callable[[], int], Callable[[], None]] | None:
        hooks = tuple(ref() for ref in self._loader) if self._loader is not None else ()
        return hooks if hooks and None not in hooks else None  # type: ignore[return-value]

    def loader_sampler(
        self, *, distributed: bool, shuffle: Any, batch_size: int | None, drop_last: bool, seed: int
    ) -> MixSampler | ElasticMixSampler:
        """The sampler a loader reads this Mix with (``OwnOrder``, NOTE [ Choosing the order ]
        in sampling/choice.py); the loader's ``seed`` is the order's when the Mix has none."""
        if self.seed is None:
            self.use_seed(seed)
        return mix_sampler(self, distributed, shuffle, batch_size, drop_last)

    def set_weights(self, weights: Mapping[str, float], at: int | None = None) -> int:
        """Change the weights from the next sample the training loop has not seen.

        See NOTE [ Weight changes ]: the change is part of the loader's state, and a rerun or
        resume gives the same order.

        Args:
            weights: source name -> weight, for every source.
            at: the position of the mixed stream to change at (default: the attached loader's
                next unseen sample).

        Returns:
            The position the weights change at.

        Raises:
            ValueError: for bad weights, a policy that cannot change weights, ``at`` before
                the loader's next unseen sample, or no ``at`` without a loader.
        """
        if self.policy not in ENDLESS:
            raise ValueError(f"policy {self.policy!r} cannot change weights: use 'cycle'")
        checked = _check_weights(weights, list(self.datasets), "weights")
        hooks = self._loader_hooks()
        unseen = hooks[0]() if hooks is not None else None
        if at is None and unseen is None:
            raise ValueError("pass at= (a position of the mixed stream): no loader reads this Mix")
        if at is not None and unseen is not None and at < unseen:
            raise ValueError(f"at={at} is before the loader's next unseen sample ({unseen})")
        position = unseen if at is None else int(at)
        self.history = [entry for entry in self.history if entry[0] != position]
        self.history.append((position, checked, "call"))
        self.history.sort(key=lambda entry: entry[0])
        self._rebuild()
        if hooks is not None:
            hooks[1]()
        return position

    def weights_at(self, position: int) -> dict[str, float]:
        """The weights in force at a position of the mixed stream."""
        return self.order.weights_at(self.order.split(position)[1])

    def realised(self, start: int, end: int) -> dict[str, int]:
        """How many samples of each source global positions ``[start, end)`` of one epoch
        hold (in O(sources)): what a loader that read them delivered."""
        return {k: v for k, v in self.order.realised(start, end).items() if k in self.sizes}

    def state_dict(self) -> dict[str, Any]:
        """The mix's part of a loader state (seed, settings, sources, weight history)."""
        return build_mix_state(self)

    def resume_from(self, state: dict[str, Any], epoch: int, position: int) -> Any:
        """Check a state's mix against this one; return what applies it (after the loader's
        own checks). See NOTE [ Resuming a mix whose sources changed ].

        Raises:
            ValueError: naming the field or source that prevents an exact resume.
        """
        stream = position if self.policy not in ENDLESS else epoch * len(self) + position
        history = merge_history(self, state, stream)

        def apply() -> None:
            self._order_seed = state["seed"]
            self.history = history
            self._rebuild()

        return apply


def mix_sampler(
    mix: Mix, distributed: bool, shuffle: Any, batch_size: int | None, drop_last: bool
) -> MixSampler | ElasticMixSampler:
    """The sampler ``fastloader.DataLoader`` reads a ``Mix`` with (``shuffle`` only decides,
    with ``distributed=True``, whether a short last step is padded: training, or split
    without repeats: evaluation)."""
    if distributed:
        return ElasticMixSampler(mix, batch_size or 1, shuffle=bool(shuffle), drop_last=drop_last)
    return MixSampler(mix)
