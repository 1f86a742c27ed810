"""Fuzzing users' own files in CI: structural mutations of an HDF5 file and an LMDB environment
fastloader did not write, each read in a subprocess (ours, and the library's own reading in
another), so a crash is seen as a crash. Every trial must end in samples equal to the original
or to h5py's / py-lmdb's reading of the damaged file, or a PackError (benchmarks/fuzz_users.py;
bounded: 2 x 40 trials)."""

from __future__ import annotations

import pytest

from benchmarks.fuzz_users import OUTCOMES, classify, fuzz

TRIALS = 40


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hdf5", "lmdb"])
def test_damaged_users_files_give_pack_error_or_what_the_library_reads(tmp_path, kind):
    counts, by_kind = fuzz(tmp_path, kind, TRIALS, seed=11)
    assert sum(cells["of which refused"] for cells in by_kind.values()) > 0  # damage was seen
    assert counts == {**dict.fromkeys(OUTCOMES, 0), "correct or PackError": TRIALS}, by_kind


def test_the_harness_sees_silent_damage_and_crashes():
    # HDF5 samples: one digest per field, each the original's or h5py's reading
    original = {"open": "ok", "names": ["a", "b"], "samples": [["x", "p"], ["y", "q"]]}
    library = {"open": "ok", "names": ["a", "b"], "samples": [["x", "p"], ["z", "error"]]}
    assert classify(original, None, library) == "crashed"
    assert classify(original, {"open": "PackError"}, None) == "correct or PackError"
    assert classify(original, dict(original), None) == "correct or PackError"
    mixed = {**original, "samples": [["x", "p"], ["z", "q"]]}  # a's byte changed, b as before
    assert classify(original, mixed, library) == "correct or PackError"
    assert classify(original, mixed, {"open": "error"}) == "silently wrong"
    assert classify(original, {**original, "samples": [["x", "p"], "PackError"]}, None) == (
        "correct or PackError"
    )
    assert classify(original, {**original, "samples": [["x", "p"]]}, library) == "silently wrong"
    assert classify(original, {**original, "names": ["a"]}, None) == "silently wrong"
    assert classify(original, {"open": "other: KeyError"}, None) == "other exception"
    # LMDB samples: (key, value) whole
    keys = {"open": "ok", "names": [], "samples": [["k1", "v1"], ["k2", "v2"]]}
    shifted = {**keys, "samples": [["k1", "v2"], ["k2", "v1"]]}
    assert classify(keys, shifted, {**keys, "samples": [["k1", "v1"], ["k2", "v1"]]}) == (
        "silently wrong"
    )
