"""Fuzzing sharded packs in CI: one shard of a sharded pack (LMDB and HDF5, by columns and by
records) damaged by byte flips or a truncation, the epoch read through the loader (shuffled,
shard-aware, and in a Mix with a local pack) and sample by sample, in a child that may crash.
Every trial must end in the source's exact samples or a PackError naming the damaged shard
(benchmarks/fuzz_shards.py; bounded: 20 trials)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fuzz_shards import OUTCOMES, Samples, classify, fuzz, row_mismatch


@pytest.mark.slow
def test_a_damaged_shard_gives_the_exact_samples_or_a_pack_error_naming_it(tmp_path):
    report = fuzz(tmp_path, trials=20, seed=7, seconds=600, chunk=10)
    assert report["trials"] == 20
    assert report["counts"] == {**dict.fromkeys(OUTCOMES, 0), OUTCOMES[0]: 20}, report["cases"]


def test_the_harness_sees_a_wrong_field_and_an_error_without_the_shard():
    row = dict(Samples()[5])
    assert row_mismatch("shards", row) is None
    row["kp"] = row["kp"].copy()
    row["kp"][0, 0] += 1
    assert "kp" in row_mismatch("shards", row)
    assert "label" in row_mismatch("shards", {**Samples()[5], "label": 6})
    assert row_mismatch("shards", {**Samples()[5], "boxes": np.zeros((0, 4), np.float64)})
    clean = {"wrong": [], "error": None}
    result = {"epoch": clean, "samples": {"wrong": [], "errors": []}, "shard": "shard-00001.h5"}
    assert classify(result) == "exact or PackError"
    refused = {**clean, "error": "PackError: /x/shard-00001.h5: damaged"}
    assert classify({**result, "epoch": refused}) == "exact or PackError"
    unnamed = {**clean, "error": "PackError: damaged"}
    assert classify({**result, "epoch": unnamed}) == "PackError not naming the shard"
    assert classify({**result, "epoch": {**clean, "wrong": ["shards 3: field 'kp'"]}}) == (
        "silently wrong"
    )
    assert classify(None) == "crashed"
