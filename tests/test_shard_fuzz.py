"""Fuzzing sharded packs in CI: one shard of a sharded pack (LMDB and HDF5, by columns and by
records) damaged by byte flips or a truncation, the epoch read through the loader (shuffled,
shard-aware, and in a Mix with a local pack) and sample by sample, in a child that may crash.
Every trial must end in the source's exact samples or a PackError naming the damaged shard
(benchmarks/fuzz_shards.py; bounded: 20 trials). Undamaged, every row of an epoch is the
source's sample, with 0 and 2 workers."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fuzz_shards import (
    OUTCOMES,
    PACKS,
    Samples,
    classify,
    fuzz,
    make_local,
    make_sharded,
    read_epoch,
    read_samples,
    row_mismatch,
)
from fastloader import ShardedDataset
from fastloader.shards.stores import LocalStore, read_manifest


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


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("shards")
    built = {key: make_sharded(workdir / "-".join(key), *key) for key in PACKS}
    return built, make_local(workdir / "local.lmdb")


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("key", PACKS, ids="-".join)
def test_every_row_of_a_sharded_epoch_is_the_sources_sample(packs, key, workers):
    # shuffled, in the shard-aware order and in a Mix with a local pack; batches of 10 cut
    # shards (read by columns across shards where the layout is columns): label and every field
    built, local = packs
    folder = built[key]
    assert len(read_manifest(LocalStore(folder)).shards) >= 3
    if key[1] == "columns":  # the loader's batches come from the read by columns
        assert ShardedDataset(folder).read_batch_columns(list(range(0, 96, 9))) is not None
    for order, mixed in (("shuffle", None), ("shard_order", None), ("shuffle", local)):
        assert read_epoch(folder, mixed, workers, 5, order) == {"wrong": [], "error": None}
    assert read_samples(folder) == {"wrong": [], "errors": []}
