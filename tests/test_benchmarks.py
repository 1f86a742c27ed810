"""Smoke test of the benchmark suite: ``python -m benchmarks --size tiny`` runs and reports.

It needs none of the bench extras: without scikit-image the photos are synthetic, without
matplotlib the plots are skipped with a note, without psutil worker memory comes from /proc,
and without litdata the peer rows are skipped with a reason. No timing is asserted: the numbers
are checked for their structure (finite, not negative), never for their size.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# The suite is not installed (only fastloader is): import it from the checkout, however
# pytest was started.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import COMPARISONS  # noqa: E402
from benchmarks.__main__ import main  # noqa: E402
from benchmarks._photos import ResizeCenterCrop, make_image_folder, scan_image_folder  # noqa: E402
from benchmarks._stats import significant  # noqa: E402
from benchmarks.report import format_table, format_value, render  # noqa: E402

# Columns that are differences, so may be zero or negative (memory growth).
SIGNED = ("growth",)


def _numbers(value: object, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a JSON value, with the path of keys that leads to it."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    assert main(["--size", "tiny", "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text()), out


@pytest.mark.slow
def test_tiny_run_reports_every_comparison(tiny_results: tuple[dict, Path]) -> None:
    results, out = tiny_results
    assert results["size"] == "tiny"
    assert set(results["machine"]) >= {"cpu_count", "platform", "torch", "python", "date"}
    assert list(results["comparisons"]) == list(COMPARISONS)
    for name, result in results["comparisons"].items():
        assert "error" not in result, f"{name} failed:\n{result['error']}"
        if result["skipped"] is not None:
            assert isinstance(result["skipped"], str) and result["skipped"], name
            continue
        assert result["rows"], f"{name} has no rows"
        # packing's ratios are against litdata: without it, they are skipped with a reason
        assert result["ratios"] or result.get("peer_skipped"), f"{name} has no ratios"
    assert (out / "results.md").read_text().startswith("# fastloader benchmarks, size tiny")
    assert not (out / "work").exists(), "the generated data should be removed"


@pytest.mark.slow
def test_tiny_run_numbers_are_finite_and_not_negative(tiny_results: tuple[dict, Path]) -> None:
    """Every number is finite, and no rate, time or ratio is negative (a structural check: the
    values are timings of a tiny run on a machine that may be busy, so none is compared)."""
    results, _ = tiny_results
    for name, result in results["comparisons"].items():
        for path, number in _numbers(result, name):
            assert math.isfinite(number), f"{path} = {number}"
        tables = {key: value for key, value in result.items() if key.endswith("rows")}
        for path, number in _numbers({**tables, "ratios": result["ratios"]}, name):
            if not any(word in path.rsplit(".", 1)[-1] for word in SIGNED):
                assert number >= 0, f"{path} = {number}"


def test_reported_ratios_keep_significant_digits() -> None:
    """A ratio far from 1 is reported with its size, never as 0 (a tiny run's persistent pool
    may have loaded a whole short epoch ahead: 0.0004x, which 3 decimals made 0.0)."""
    assert significant(0.000412345) == 0.000412
    assert significant(1234.567) == 1230.0 and significant(0.98765) == 0.988
    assert format_value("vs_torch", 0.000412) == "0.00041x"
    assert format_value("vs_torch", 0.98765) == "0.99x"
    assert "0.00041x" in format_table([{"loader": "a", "vs_b": 0.000412}])


@pytest.mark.slow
def test_tiny_run_skips_only_with_a_reason(tiny_results: tuple[dict, Path]) -> None:
    results, out = tiny_results
    comparisons = results["comparisons"]
    if not torch.cuda.is_available():
        assert "CUDA" in comparisons["gpu_step"]["skipped"]
    peer = comparisons["packing"].get("peer_skipped")
    assert peer is None or (isinstance(peer, str) and "litdata" in peer)
    if results["plots_skipped"] is None:
        assert results["plots"] and all((out / name).is_file() for name in results["plots"])
    else:
        assert "matplotlib" in results["plots_skipped"]


def test_image_folder_follows_image_folder_rules(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "photos", 12)
    samples, classes = scan_image_folder(root)
    assert len(samples) == 12
    assert classes == sorted(classes) and len(classes) >= 4
    assert [label for _, label in samples] == sorted(label for _, label in samples)
    assert all(path.parent.name == classes[label] for path, label in samples)
    assert make_image_folder(tmp_path / "photos", 12) == root  # made once, then reused


def test_resize_center_crop_gives_the_same_shape_for_every_input() -> None:
    array = np.random.default_rng(0).integers(0, 256, (171, 256, 3), dtype=np.uint8)
    crop = ResizeCenterCrop(224)
    inputs = [Image.fromarray(array), array, torch.from_numpy(array).permute(2, 0, 1)]
    for image in inputs:
        output = crop(image)
        assert output.shape == (3, 224, 224) and output.dtype == torch.uint8


def test_tables_render_ratios_and_missing_cells() -> None:
    rows = [{"name": "a", "rate": 1234.5, "vs_base": 1.0}, {"name": "b", "rate": 0.5}]
    text = format_table(rows)
    assert "1.00x" in text and "-" in text.splitlines()[-1]
    assert format_table(rows, markdown=True).startswith("| name | rate | vs_base |")
    report = render(
        {
            "machine": {"cpu_count": 2},
            "size": "tiny",
            "comparisons": {"x": {"rows": rows, "ratios": {"b_vs_a": 0.5}, "skipped": None}},
        }
    )
    assert "b_vs_a: 0.50x" in report


@pytest.mark.slow
def test_transport_comparison_runs_tiny(tmp_path: Path) -> None:
    from benchmarks import transport

    result = transport.run("tiny", tmp_path)
    kinds = {(row["data"], row["num_workers"]) for row in result["rows"]}
    assert kinds == {
        (kind, workers)
        for kind in ("pose64", "pose256", "tokens", "index", "images")
        for workers in (0, 1, 2)
    }
    for row in result["rows"]:  # the columns each row has (the values are timings: unchecked)
        columns = ["fastloader_main_cpu_ms_per_batch", "vs_torch"]
        columns += ["vs_fastloader_pickled"] if row["num_workers"] else []
        for column in columns:
            assert math.isfinite(row[column]) and row[column] >= 0, (row, column)
    assert math.isfinite(result["ratios"]["pose64_2w_vs_fastloader_0w"])


def test_a_missing_peer_gives_a_row_that_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without litdata or MosaicML streaming the peer table still has their rows, each saying
    how to install the peer, and fastloader's rows read exactly the file's samples."""
    from benchmarks import peer_litdata, peer_rows

    monkeypatch.setattr(peer_litdata, "available", lambda: False)
    monkeypatch.setenv("FASTLOADER_MDS_PYTHON", str(tmp_path / "no-such-venv" / "python"))
    result = peer_rows.any_sample("tiny", tmp_path)
    files = {row["samples"] for row in result["rows"]}
    assert len(files) == 2  # the pose samples and any_sample's own
    for reader, _, install in peer_rows.PEERS.values():
        peer = [row for row in result["rows"] if row["reader"] == reader]
        assert len(peer) == len(files) and all(row["note"] == install for row in peer), reader
        assert all(row["samples_per_s"] is None for row in peer)
        assert install.startswith("not installed: ") and "pip install" in install
    ours = [row for row in result["rows"] if "note" not in row]
    assert len(ours) == 3 * len(files) and all(row["samples_match"] is True for row in ours)
    assert not any("_over_" in key for key in result["ratios"])  # no peer, no ratio


def test_epoch_checksum_ignores_order_but_not_bytes_or_repeats() -> None:
    """The peer rows' honesty check: any order of the same samples gives the file's checksum;
    a changed byte, a repeated or a missing sample does not."""
    from benchmarks.peer_samples import epoch_digest

    images = np.arange(4 * 3, dtype=np.uint8).reshape(4, 3)
    names = ["a", "b", "c", "d"]

    def batches(order: list[int], image: np.ndarray = images) -> list[dict]:
        return [{"image": torch.from_numpy(image[order]), "name": [names[i] for i in order]}]

    fields = ("image", "name")
    expected = epoch_digest(batches([0, 1, 2, 3]), fields)
    assert epoch_digest(batches([3, 1, 0, 2]), fields) == expected
    flipped = images.copy()
    flipped[2, 1] ^= 1
    assert epoch_digest(batches([0, 1, 2, 3], flipped), fields) != expected
    assert epoch_digest(batches([0, 1, 2, 2]), fields) != expected
    assert epoch_digest(batches([0, 1, 2]), fields)[0] == 3
