"""Packs of any sample hold only what reads back exactly: every value pack() accepts comes back
equal (0-d arrays, JSON up to the reader's depth), and what would not is refused naming the
sample and the field (JSON int keys and tuples, floats that overflow or round)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastloader import HDF5Dataset, LMDBDataset, PackError, pack
from fastloader.datasets.collate import RaggedFieldError, pad_ragged
from fastloader.formats import bounded_json
from fastloader.formats import fields as fields_format
from fastloader.formats import lmdb as lmdb_format
from fastloader.formats.verify import verify
from fastloader.packing.fields import SampleSchemaError

OPEN = {".lmdb": LMDBDataset, ".h5": HDF5Dataset}
ROOT = Path(__file__).resolve().parents[1]


class Samples:
    """A dataset of the samples given."""

    def __init__(self, samples: list) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.fixture(params=[".lmdb", ".h5"])
def suffix(request):
    return request.param


def test_zero_d_arrays_round_trip_and_verify(tmp_path, suffix):
    samples = [{"x": np.array(index * 1.5, np.float32), "n": np.array(index)} for index in range(4)]
    path = tmp_path / f"z{suffix}"
    pack(Samples(samples), path, workers=0)
    dataset = OPEN[suffix](path)
    for index, want in enumerate(samples):
        got = dataset[index]
        assert got["x"].shape == () and got["x"].dtype == np.float32 and got["x"] == want["x"]
        assert got["n"].shape == () and got["n"] == index
    assert verify(path).ok


def test_json_as_deep_as_the_reader_reads_packs_deeper_is_refused(tmp_path, suffix):
    deepest = nested(bounded_json.MAX_DEPTH)
    path = tmp_path / f"j{suffix}"
    pack(Samples([{"j": deepest}, {"j": [1]}]), path, workers=0)
    assert OPEN[suffix](path)[0]["j"] == deepest
    too_deep = Samples([{"j": [1]}, {"j": nested(bounded_json.MAX_DEPTH + 1)}])
    with pytest.raises(SampleSchemaError, match=r"sample 1 field 'j'.*deeper than 16"):
        pack(too_deep, tmp_path / f"k{suffix}", workers=0)
    with pytest.raises(SampleSchemaError, match="sample 0 field 'j'.*deeper"):
        pack(Samples([{"j": nested(100_000)}]), tmp_path / f"l{suffix}", workers=0)


@pytest.mark.parametrize(
    "value, match",
    [
        ({1: "a"}, r"dict key 1 \(int\) at top: JSON keys are str"),
        ({"a": {(1, 2): 3}}, r"dict key \(1, 2\) \(tuple\) at \['a'\]"),
        ({"box": (1, 2)}, r"a tuple at \['box'\]"),
        ({"x": float("nan")}, "not JSON-able"),
        ({"x": object()}, "not JSON-able"),
    ],
)
def test_json_that_would_come_back_changed_is_refused_naming_sample_and_field(
    tmp_path, value, match
):
    with pytest.raises(SampleSchemaError, match=rf"sample 1 field 'meta': {match}"):
        pack(Samples([{"meta": {}}, {"meta": value}]), tmp_path / "p.lmdb", workers=0)
    assert not (tmp_path / "p.lmdb").exists()


def test_json_keys_and_values_come_back_as_written(tmp_path, suffix):
    value = {"a": [1, 2.5, None, True, "é"], "b": {"c": [[]], "-0.0": -0.0}, "big": 10**30}
    path = tmp_path / f"v{suffix}"
    pack(Samples([{"meta": value}]), path, workers=0)
    got = OPEN[suffix](path)[0]["meta"]
    assert got == value and type(got["big"]) is int


@pytest.mark.parametrize(
    "value, match",
    [
        (10**400, r"sample 1 field 'f': an int of 1329 bits is too large for a float64 field"),
        (2**53 + 1, r"sample 1 field 'f': the int 9007199254740993 has no exact float64"),
    ],
)
def test_floats_that_cannot_be_stored_exactly_are_named(tmp_path, value, match):
    with pytest.raises(SampleSchemaError, match=match):
        pack(Samples([{"f": 0.5}, {"f": value}]), tmp_path / "f.lmdb", workers=0)


def test_ints_in_float_fields_that_fit_exactly_are_kept(tmp_path):
    pack(Samples([{"f": 0.5}, {"f": 3}, {"f": 2**53}]), tmp_path / "f.lmdb", workers=0)
    dataset = LMDBDataset(tmp_path / "f.lmdb")
    assert [dataset[i]["f"] for i in range(3)] == [0.5, 3.0, float(2**53)]


def test_a_tensor_numpy_cannot_hold_is_named(tmp_path):
    samples = Samples([{"t": torch.zeros(2, dtype=torch.bfloat16)}])
    with pytest.raises(SampleSchemaError, match="field 't'"):
        pack(samples, tmp_path / "t.lmdb", workers=0)


def test_verify_reads_every_field_back(tmp_path, suffix, monkeypatch):
    samples = Samples([{"x": np.arange(3), "j": {"a": 1}, "s": "é"} for _ in range(3)])
    path = tmp_path / f"v{suffix}"
    pack(samples, path, workers=0, layout="records")  # columns: tests/test_column_packs.py
    assert verify(path).ok

    def refuses(self, payload, where, image):  # a payload its checksum covers, unreadable
        raise PackError(f"{where}: corrupt field 'x' (test)")

    monkeypatch.setattr(fields_format.FieldsDecoder, "decode", refuses)
    report = verify(path)
    assert not report.ok and report.bad[0] == (0, "corrupt field 'x' (test)")


def test_the_lmdb_writer_grows_its_map_with_the_data(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_format, "_FIRST_MAP_SIZE", 1 << 20)
    rng = np.random.default_rng(0)
    samples = [{"x": rng.integers(0, 255, 300_000, dtype=np.uint8)} for _ in range(20)]
    pack(Samples(samples), tmp_path / "g.lmdb", workers=0)
    dataset = LMDBDataset(tmp_path / "g.lmdb")
    assert all(np.array_equal(dataset[i]["x"], samples[i]["x"]) for i in range(20))
    assert verify(tmp_path / "g.lmdb").ok


def test_packing_to_lmdb_works_under_a_4_gb_address_space_limit(tmp_path):
    folder = tmp_path / "images"
    for index in range(4):
        (folder / "ab"[index % 2]).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 32), (index * 40, 0, 0)).save(
            folder / "ab"[index % 2] / f"{index}.png"
        )
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from fastloader.cli import main\n"
        "sys.exit(main([sys.argv[1], sys.argv[2], '--workers', '0']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder), str(tmp_path / "p.lmdb")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert verify(tmp_path / "p.lmdb").ok


# --- pad_ragged: NOTE [ Padding never changes data ] ------------------------------------------


def _ragged(dtype_a, dtype_b=None, **extra) -> list[dict]:
    return [
        {"x": np.zeros(2, dtype_a), **{k: v[0] for k, v in extra.items()}},
        {"x": np.ones(3, dtype_b or dtype_a), **{k: v[1] for k, v in extra.items()}},
    ]


def test_pad_ragged_refuses_mixed_dtypes_instead_of_casting():
    with pytest.raises(RaggedFieldError, match=r"field 'x' mixes dtypes \(float32, int64\)"):
        pad_ragged()(_ragged(np.int64, np.float32))


@pytest.mark.parametrize(
    "pad_value, dtype",
    [(-1, np.uint8), (256, np.uint8), (0.5, np.int32), (2, bool), (1e6, np.float16)],
)
def test_pad_ragged_refuses_a_pad_value_the_dtype_cannot_hold(pad_value, dtype):
    with pytest.raises(ValueError, match=rf"pad_value {pad_value!r} cannot be stored in field 'x'"):
        pad_ragged(pad_value)(_ragged(dtype))


def test_pad_ragged_never_writes_lengths_over_a_field():
    batch = _ragged(np.float32, x_lengths=([7], [8]))
    with pytest.raises(ValueError, match="already have a field 'x_lengths'"):
        pad_ragged()(batch)


def test_pad_ragged_pads_with_values_the_dtype_holds():
    out = pad_ragged(-1)(_ragged(np.int8))
    assert out["x"].dtype == torch.int8 and out["x"].tolist() == [[0, 0, -1], [1, 1, 1]]
    assert out["x_lengths"].tolist() == [2, 3]
    floats = pad_ragged(float("nan"))(_ragged(np.float16))
    assert torch.isnan(floats["x"][0, 2]) and floats["x"].dtype == torch.float16
    with pytest.raises(TypeError, match="pad_value must be a number"):
        pad_ragged("0")


@pytest.mark.parametrize(
    "info, match",
    [({"a": {1: 2}}, "dict key 1 \\(int\\)"), ({"a": nested(20)}, "deeper than 16")],
)
def test_metadata_the_reader_would_refuse_is_never_written(tmp_path, info, match):
    from fastloader.formats import open_writer

    with pytest.raises(TypeError, match=match):
        open_writer(tmp_path / "m.lmdb", "lmdb", store="raw", classes=["a"], info=info)
    assert not (tmp_path / "m.lmdb").exists()
