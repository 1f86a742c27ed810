"""The demo (``python -m benchmarks --quick``): what it runs, that it prints what results.md
says, that its surprising figures carry their explanation, that the README gives the duration
its header gives, and that its progress estimates come from measured rates (or are not shown).
No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import COMPARISONS, DEMO  # noqa: E402
from benchmarks import _progress as progress  # noqa: E402
from benchmarks.__main__ import demo_duration, parse_args  # noqa: E402
from benchmarks.plots import footer, loader_panel, pipeline_panel  # noqa: E402
from benchmarks.report import loader_summary, render, summary, transport_summary  # noqa: E402


def test_the_demo_leads_with_the_pipeline_and_full_runs_everything() -> None:
    assert DEMO[0] == "pipeline" and set(DEMO) < set(COMPARISONS)
    assert parse_args(["--quick"]).only == list(DEMO)
    assert parse_args(["--size", "full"]).only == list(COMPARISONS)
    assert parse_args(["--quick", "--only", "formats"]).only == ["formats"]


def _results() -> dict:
    # Rounds where the ratio of medians (2000/1000 = 2.0) differs from the median of the
    # per-round ratios (1.5): the summary must print what results.md prints.
    rounds = {"torch": [1000.0, 2000.0, 500.0], "torch_persistent": [1000.0, 1000.0, 1000.0]}
    rounds["fastloader"] = [1500.0, 3000.0, 2000.0]
    loader_rows = [
        {
            "loader": name,
            "steady_samples_per_s": sorted(values)[1],
            "first_batch_ms_later_median": {"torch": 60.0, "torch_persistent": 30.0}.get(name, 3.0),
            "vs_torch_epoch_start": {"torch": 1.0, "torch_persistent": 2.0}.get(name, 20.0),
        }
        for name, values in rounds.items()
    ]
    pipeline_rows = [
        {"loader": "torch_folder", "what": "torch", "samples_per_s": 500.0, "vs_torch": 1.0},
        {"loader": "fused", "what": "fastloader fused", "samples_per_s": 900.0, "vs_torch": 1.87},
    ]
    return {
        "machine": {"cpu_count": 2, "load_average": 3.5},
        "size": "quick",
        "seconds": 90.0,
        "comparisons": {
            "pipeline": {
                "rows": pipeline_rows,
                "ratios": {"fused_vs_torch": 1.87},
                "config": {"batch_size": 32, "rounds": 15, "photos": 640},
                "peers_skipped": {"dali_cpu": "not installed (pip install nvidia-dali-cuda120)"},
            },
            "loader": {
                "rows": loader_rows,
                "ratios": {"epoch_start_speedup_vs_torch_persistent": 10.0},
                "throughput_samples_per_s": rounds,
            },
        },
    }


def test_the_printed_summary_is_the_first_section_of_results_md(tmp_path: Path) -> None:
    results = _results()
    printed = summary(results, tmp_path, [tmp_path / "pipeline.png"])
    assert printed.index("training pipeline") < printed.index("fastloader vs torch's DataLoader")
    assert "1.87x" in printed and "load average 3.5" in printed
    assert "pip install nvidia-dali-cuda120" in printed
    assert printed in render(results, markdown=True, printed=printed)


def test_loader_ratios_are_medians_of_per_round_ratios() -> None:
    text = loader_summary(_results()["comparisons"]["loader"])
    rows = [line.split() for line in text.splitlines() if line.split()[1:2] != []]
    fastloader = " ".join(next(row for row in rows if row[0] == "fastloader" and row[1].isdigit()))
    assert "1.50x" in fastloader  # median of 1.5, 1.5, 4.0 vs torch; not 2000/1000
    assert "10.0x" in fastloader  # the first-batch ratio results.md has, not 30/3 rounded


def test_progress_lines_estimate_from_the_measured_rate(capsys: pytest.CaptureFixture) -> None:
    pace = progress.Pace()
    pace.record(10.0, 30.0)  # the first stage ran 3x slower than usual here
    assert pace.scale(20.0) == 60.0
    with progress.Stage("[1/1] demo", pace.scale(20.0), bar=False) as stage:
        progress.note("making photos")
        assert "making photos" in stage._status() and "s left" in stage._status()  # the pace's
        progress.plan(4)
        stage._planned_at -= 10.0  # the 2 units below took 10 s
        progress.advance(2)
        progress.note("round 3 of 4")
        assert "~60 s left" not in stage._status()  # from the 2 units measured, not the pace
        assert "round 3 of 4" in stage._status() and "~10 s left" in stage._status()
        stage.finish("done in 1 s")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[1/1] demo ... (~60 s)", "[1/1] demo: done in 1 s"]  # notes alone: silent
    progress.note("after the stage: ignored")
    assert capsys.readouterr().err == ""


def test_the_loader_table_names_each_column_once() -> None:
    text = loader_summary(_results()["comparisons"]["loader"])
    header = next(line for line in text.splitlines() if line.startswith("loader "))
    columns = [column.strip() for column in header.split("  ") if column.strip()]
    assert len(columns) == 7 and len(set(columns)) == len(columns), columns


def test_plots_say_what_is_better_with_human_names_ratios_date_and_load() -> None:
    results = _results()
    results["machine"].update(date="2026-11-26T09:40:00+00:00", load_average_at_end=4.0)
    assert footer(results).startswith("2026-11-26 09:40 UTC")
    assert "load average 3.5 → 4.0" in footer(results)
    loader = loader_panel(results["comparisons"]["loader"])
    assert "torch DataLoader, persistent_workers=True" in loader["labels"]
    assert "fastloader.DataLoader" in loader["labels"]
    # as the printed table: the median of per-round ratios (1.5, 3.0, 2.0), not 2000/1000
    assert loader["ratios"][loader["labels"].index("fastloader.DataLoader")] == 2.0
    assert loader["spreads"][-1] == (500.0, 1000.0)  # rounds 1500..3000 around 2000
    pipeline = pipeline_panel(results["comparisons"]["pipeline"])
    assert pipeline["labels"] == ["torch", "fastloader fused"] and pipeline["ratios"][1] == 1.87
    assert len(set(pipeline["colours"])) == 2  # the baseline stands out


def _transport_row(num_workers: int, vs_torch: float) -> dict:
    """A row of the transport comparison (pose64: 150k samples/s, 0.13 vs torch's 0.82 ms of
    main-process CPU per batch)."""
    return {
        "data": "pose64",
        "num_workers": num_workers,
        "fastloader_samples_per_s": 150000.0,
        "vs_torch": vs_torch,
        "fastloader_main_cpu_ms_per_batch": 0.13,
        "torch_main_cpu_ms_per_batch": 0.82,
    }


def test_the_demo_shows_the_transport_table_beside_the_pipeline(tmp_path: Path) -> None:
    row = _transport_row(num_workers=2, vs_torch=6.0)
    transport = {
        "rows": [row],
        "ratios": {"pose64_2w_vs_fastloader_0w": 0.8, "pose64_0w_vs_plain_loop": 0.93},
        "config": {"rounds": 5},
    }
    results = _results()
    results["comparisons"]["transport"] = transport
    text = summary(results, tmp_path, [])
    table = transport_summary(transport)
    assert table in text and text.index(table) < text.index("fastloader vs torch's DataLoader")
    assert "pose HDF5 fields, batch 64" in table and "6.00x" in table and "0.82" in table
    assert "0.80x of fastloader's in-process rate" in table


def test_the_readme_gives_the_demo_duration_its_header_gives() -> None:
    readme = (Path(ROOT) / "README.md").read_text()
    (line,) = [
        line for line in readme.splitlines() if line.startswith("python3 -m benchmarks --quick")
    ]
    assert demo_duration() in line, (demo_duration(), line)
    docs = (Path(ROOT) / "docs" / "benchmarks.md").read_text()
    (line,) = [
        line for line in docs.splitlines() if line.startswith("python3 -m benchmarks --quick")
    ]
    assert demo_duration() in line, (demo_duration(), line)


def test_an_estimate_is_measured_or_not_shown(capsys: pytest.CaptureFixture) -> None:
    busy = progress.Pace(idle=False)
    busy.record(10.0, 25.0)
    assert busy.scale(20.0) is None  # a busy machine slows each stage by its own factor
    idle = progress.Pace()
    idle.record(10.0, 12.0)
    assert idle.scale(20.0) == 24.0
    with progress.Stage("[1/1] demo", 5.0, bar=False) as stage:
        assert "s left" in stage._status()
        stage._started -= 10.0  # it has run past its estimate
        assert stage.left_s() is None and "left" not in stage._status()  # never "~0 s left"
        stage.finish("done")
    with progress.Stage("[1/1] demo", None, bar=False) as stage:
        progress.plan(4)
        assert stage.left_s() is None  # planned, nothing done yet: no rate to go on
        stage.finish("done")
    capsys.readouterr()


def test_the_loader_table_explains_steady_near_1x_and_a_much_sooner_first_batch() -> None:
    loader = _results()["comparisons"]["loader"]
    loader["config"] = {"samples": 512, "batch_size": 32, "num_workers": 2}
    text = loader_summary(loader)
    assert "first batch comes 20.0x sooner while steady samples/s is 1.50x torch's" in text
    assert "cross-epoch prefetch" in text and "not by a faster rate" in text
    assert "torch waits 60 ms per epoch" in text


def test_the_transport_table_explains_its_rows_without_workers() -> None:
    row = _transport_row(num_workers=0, vs_torch=7.0)
    text = transport_summary({"rows": [row], "ratios": {}, "config": {"rounds": 5}})
    assert "one __getitems__ call" in text
    results = _results()
    results["machine"]["main_process_torch_threads"] = 1
    assert "1 intra-op thread" in summary(results, Path("out"), [])


def test_workers_slower_than_the_main_process_on_short_epochs_say_why() -> None:
    from fastloader.loader.transport.groups import DECIDE_AT

    row = _transport_row(num_workers=2, vs_torch=6.0)
    ratios = {"pose64_2w_vs_fastloader_0w": 0.43, "pose64_0w_vs_plain_loop": 2.2}
    short = {"rows": [row], "ratios": ratios, "config": {"rounds": 5, "sizes": (5, 2048)}}
    assert (
        f"32 batches, and cheap batches travel several to a message only from batch {DECIDE_AT}"
        in (transport_summary(short))
    )
    long = {**short, "config": {"rounds": 5, "sizes": (5, 64 * 4 * DECIDE_AT)}}
    assert "why 2 workers" not in transport_summary(long)  # long epochs: nothing to explain
