"""Fuzzing packs in CI: random byte flips and truncations of small packs of each backend and
store, each read in a subprocess so that a crash is seen as a crash. Every trial must end in a
PackError or samples identical to the original (benchmarks/fuzz.py; bounded: 4 x 30 trials).
Packs laid out by columns (format 5) too, read sample by sample and batch by column
(benchmarks/fuzz_columns.py; bounded: 2 x 30 trials)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import fuzz_columns
from benchmarks.fuzz import CRASH_FOR_TEST, classify, damage, make_pack, read_all, run_trials

SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}
FLIPS, TRUNCATIONS = 22, 8


@pytest.mark.slow
@pytest.mark.parametrize("store", ["raw", "encoded"])
@pytest.mark.parametrize("backend", sorted(SUFFIX))
def test_damaged_packs_give_pack_error_or_identical_samples(tmp_path, backend, store):
    original = make_pack(tmp_path / f"orig{SUFFIX[backend]}", backend, store)
    expected = read_all(str(original))
    assert expected["open"] == "ok" and all(isinstance(s, list) for s in expected["samples"])
    data = original.read_bytes()
    rng = np.random.default_rng([sorted(SUFFIX).index(backend), len(store)])  # seeded
    paths = []
    for trial in range(FLIPS + TRUNCATIONS):
        path = tmp_path / f"{trial}{SUFFIX[backend]}"
        path.write_bytes(damage(data, rng, "flip" if trial < FLIPS else "truncate"))
        paths.append(path)
    outcomes = [classify(expected, result) for result in run_trials(paths, timeout=120)]
    bad = {
        str(path.name): outcome
        for path, outcome in zip(paths, outcomes, strict=True)
        if outcome != "correct or PackError"
    }
    assert bad == {}


@pytest.mark.slow
def test_the_harness_sees_crashes_and_silent_damage(tmp_path):
    good = make_pack(tmp_path / "good.lmdb", "lmdb", "raw")
    crash = tmp_path / f"x{CRASH_FOR_TEST}.lmdb"
    results = run_trials([good, crash, good])
    assert results[0] == results[2] == read_all(str(good)) and results[1] is None
    expected = {"open": "ok", "length": 1, "classes": ["a"], "samples": [[0, "d", [1], "a/0"]]}
    assert classify(expected, None) == "crashed"
    changed = {**expected, "samples": [[0, "e", [1], "a/0"]]}
    assert classify(expected, changed) == "silently wrong"
    assert classify(expected, {**expected, "samples": ["PackError"]}) == "correct or PackError"
    assert classify(expected, {"open": "other: KeyError"}) == "other exception"


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(SUFFIX))
def test_damaged_column_packs_give_pack_error_or_identical_samples_and_batches(tmp_path, backend):
    original = fuzz_columns.make_pack(tmp_path / f"orig{SUFFIX[backend]}")
    expected = fuzz_columns.read_all(str(original))
    # every sample, then every batch's rows: none damaged, none an error
    assert len(expected["samples"]) == 2 * fuzz_columns.COUNT
    assert all(len(digest) == 16 for digest in expected["samples"])
    data = original.read_bytes()
    rng = np.random.default_rng([2 + sorted(SUFFIX).index(backend)])  # seeded
    paths = []
    for trial in range(FLIPS + TRUNCATIONS):
        path = tmp_path / f"{trial}{SUFFIX[backend]}"
        path.write_bytes(damage(data, rng, "flip" if trial < FLIPS else "truncate"))
        paths.append(path)
    child = ("benchmarks.fuzz_columns", "--child")
    outcomes = [classify(expected, result) for result in run_trials(paths, 120, child)]
    bad = {
        str(path.name): outcome
        for path, outcome in zip(paths, outcomes, strict=True)
        if outcome != "correct or PackError"
    }
    assert bad == {}
