"""Output of a suite run: a plain-text table, results.json, results.md and PNG plots.

Every comparison's result is a dict with ``rows`` (a list of flat dicts: one table), optional
further tables under keys ending in ``rows`` (``read_rows``), ``ratios`` (name -> ratio),
``notes`` and ``skipped`` (None, or why the comparison did not run). Columns named ``vs_*``
are ratios and print as ``1.23x``. The plots are plots.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks._stats import paired_ratio


def _ratio(value: float) -> str:
    """``0.96x``, ``54.0x``; below 0.01 two significant digits (``0.00041x``), never ``0.00x``."""
    if 0 < abs(value) < 0.01:
        return f"{value:.2g}x"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def format_value(key: str, value: Any) -> str:
    """A table cell: ratios as ``1.23x``, other numbers with about three significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.startswith("vs_") or key.endswith("_over_start"):
        return _ratio(value)
    if isinstance(value, int) or not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _ratio_key(key: str) -> str:
    """The column-style key of a ratio name: ratios print as ``1.23x``, other values plainly."""
    is_ratio = any(word in key for word in ("_vs_", "speedup", "_over_", "intervals"))
    return "vs_" + key if is_ratio else key


def _columns(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    return columns


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """Render ``rows`` as an aligned plain-text table, or a Markdown one."""
    if not rows:
        return ""
    columns = _columns(rows)
    cells = [[format_value(key, row.get(key)) for key in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(key), (int, float)) or row.get(key) is None for row in rows)
        for key in columns
    ]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |"]
        lines.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join(lines)
    widths = [
        max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)
    ]

    def line(values: list[str]) -> str:
        return "  ".join(
            value.rjust(width) if num else value.ljust(width)
            for value, width, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join(
        [line(columns), line(["-" * width for width in widths])] + [line(c) for c in cells]
    )


def _tables(result: dict) -> list[tuple[str, list[dict]]]:
    return [
        (key, value)
        for key, value in result.items()
        if key.endswith("rows") and isinstance(value, list) and value
    ]


def render(results: dict, markdown: bool = False, printed: str | None = None) -> str:
    """The whole report: machine, then per comparison its tables, ratios, notes and skips.

    ``printed``: the summary the run printed, shown first (as printed) so that the report and
    the terminal give the same numbers.
    """
    title = f"fastloader benchmarks, size {results['size']}"
    machine = ", ".join(f"{key}: {value}" for key, value in results["machine"].items())
    out = [f"# {title}" if markdown else title, "", machine]
    if printed and markdown:
        out += ["", "## Summary, as printed", "", "```text", printed, "```"]
    for name, result in results["comparisons"].items():
        seconds = result.get("seconds")
        title = f"{name}: {result.get('title', '')}".rstrip(": ")
        title = title.replace("``", "`" if markdown else "")
        if seconds is not None:
            title += f" ({seconds:.0f} s)"
        out += ["", f"## {title}" if markdown else f"== {title}"]
        if result.get("skipped"):
            out.append(f"skipped: {result['skipped']}")
            continue
        if result.get("error"):
            out.append(f"ERROR: {result['error'].strip().splitlines()[-1]}")
            continue
        for key, rows in _tables(result):
            if key != "rows":
                out += ["", f"{key.removesuffix('_rows').replace('_', ' ')}:"]
            table = format_table(rows, markdown)
            out += ["", table] if markdown else [table]
        if result.get("ratios"):
            out += ["", "ratios:"]
            bullet = "- " if markdown else "  "
            out += [
                f"{bullet}{key}: {format_value(_ratio_key(key), value)}"
                for key, value in result["ratios"].items()
            ]
        for key in ("peer_skipped",):
            if result.get(key):
                out += ["", f"{key.replace('_', ' ')}: {result[key]}"]
        if result.get("notes"):
            out += [""] + [f"{'- ' if markdown else '  note: '}{note}" for note in result["notes"]]
    return "\n".join(out) + "\n"


def write_json(results: dict, path: Path) -> None:
    """Write ``results`` as indented JSON (NaN/inf are not JSON: they raise)."""
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")


# --- the summary printed at the end of a run -----------------------------------------------

_BASELINES = ("torch", "torch_persistent")
_SMALL_TABLE = 6  # a comparison's table of at most 6 rows and 6 columns is printed in full
_LOADER_NAMES = {"torch": "torch", "torch_persistent": "torch persistent_workers=True"}
#: Where the README's table comes from.
README_RESULTS = Path(__file__).resolve().parent / "results" / "results.json"


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    """A plain table: first column left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join(
        [line(header), line(["-" * width for width in widths])] + [line(r) for r in rows]
    )


def loader_summary(result: dict) -> str:
    """The loader comparison at a glance: each loader against both torch baselines.

    Ratios are "higher is better" everywhere: samples/s over the baseline's, and the
    baseline's time to the first batch over this loader's.
    """
    rows = {row["loader"]: row for row in result.get("rows", [])}
    if not all(name in rows for name in _BASELINES):
        return ""
    rate = {name: row["steady_samples_per_s"] for name, row in rows.items()}
    first = {name: row["first_batch_ms_later_median"] for name, row in rows.items()}
    rounds = result.get("throughput_samples_per_s") or {}

    def steady(name: str, base: str) -> float:
        """As results.md: the median of per-round ratios (else the ratio of medians)."""
        if name in rounds and base in rounds:
            return paired_ratio(rounds[name], rounds[base])
        return rate[name] / rate[base]

    def epoch_start(name: str, base: str) -> float:
        """As results.md: from the unrounded times where the result has them."""
        if name == "fastloader" and base == "torch_persistent":
            return result.get("ratios", {}).get(
                "epoch_start_speedup_vs_torch_persistent", first[base] / first[name]
            )
        if base == "torch" and "vs_torch_epoch_start" in rows[name]:
            return rows[name]["vs_torch_epoch_start"]
        return first[base] / first[name]

    # each ratio column names its measure: "x torch" twice over would be ambiguous
    header = ["loader", "samples/s", "x torch", "x persistent"]
    header += ["first batch, epochs 2+", "sooner than torch", "sooner than persistent"]
    table = []
    for name in rows:
        table.append(
            [_LOADER_NAMES.get(name, name), f"{rate[name]:.0f}"]
            + [_ratio(steady(name, base)) for base in _BASELINES]
            + [f"{first[name]:.1f} ms"]
            + [_ratio(epoch_start(name, base)) for base in _BASELINES]
        )
    config = result.get("config", {})
    lines = [
        f"fastloader vs torch's DataLoader ({config.get('num_workers', 2)} workers, "
        f"batches of {config.get('batch_size', '?')} decoded JPEG photos); "
        "every ratio is higher-is-better",
        "",
        _aligned(header, table),
    ]
    startup = {name: row.get("startup_dataset_epoch2_first_batch_ms") for name, row in rows.items()}
    if "fastloader" in rows and all(startup.values()):
        ours = startup["fastloader"]
        against = ", ".join(
            f"{_LOADER_NAMES[base]} {startup[base]:.1f} ms ({_ratio(startup[base] / ours)})"
            for base in _BASELINES
        )
        lines += [
            "",
            f"dataset with {config.get('startup_s', '?')} s of start-up in each worker, first "
            f"batch of epoch 2: fastloader {ours:.1f} ms; {against}",
        ]
    lines += [
        "",
        "samples/s: steady throughput, no training step; first batch: median of epochs 2 and "
        f"later, with a {config.get('step_ms', '?')} ms training step per batch",
    ]
    if "fastloader" in rows:
        ratios = (steady("fastloader", "torch"), epoch_start("fastloader", "torch"))
        whole = result.get("ratios", {}).get("epoch_throughput_vs_torch_persistent")
        lines.append(_why_steady_and_start_differ(*ratios, whole, first, config))
    return "\n".join(lines)


def _why_steady_and_start_differ(
    steady: float, sooner: float, whole: float | None, first: dict, config: dict
) -> str:
    """The line that explains a loader table's two kinds of ratio: a steady rate near torch's
    and a first batch many times sooner."""
    epochs = (
        f" (whole epochs, that wait included: {_ratio(whole)} torch persistent_workers=True)"
        if whole
        else ""
    )
    return (
        f"why the first batch comes {_ratio(sooner)} sooner while steady samples/s is "
        f"{_ratio(steady)} torch's: steady samples/s leaves out each epoch's first batch and "
        f"is {config.get('num_workers', 2)} worker processes decoding JPEGs, the same work under "
        "every loader; the first batch is the wait at each epoch's start, which fastloader "
        "removes by loading the next epoch during the previous one (cross-epoch prefetch), not "
        f"by a faster rate. Here torch waits {first['torch']:.0f} ms per epoch{epochs}; it "
        "weighs most with short epochs or workers slow to start"
    )


def _readme_source() -> str:
    """Which run the README's table comes from, from benchmarks/results/results.json."""
    try:
        machine = json.loads(README_RESULTS.read_text())["machine"]
    except (OSError, ValueError, KeyError):
        return "The README's table comes from `python -m benchmarks --size full`."
    gpu = machine.get("cuda") or "no GPU"
    return (
        "The README's table comes from `python -m benchmarks --size full` on a "
        f"{machine.get('usable_cpus', '?')}-CPU {machine.get('processor', '')} machine shared "
        f"with other work ({gpu}; Python {machine.get('python', '?')}, torch "
        f"{machine.get('torch', '?')}; {str(machine.get('date', ''))[:10]}): "
        "compare ratios, not absolute speeds, across machines and sizes."
    )


def pipeline_summary(result: dict) -> str:
    """The headline: the training pipeline through each loader, samples/s and ratios."""
    rows = result.get("rows") or []
    config = result.get("config", {})
    with_dali = any("vs_dali" in row for row in rows)
    header = ["loader", "samples/s", "vs torch"] + (["vs DALI"] if with_dali else [])
    table = [
        [row.get("what", row["loader"]), f"{row['samples_per_s']:.0f}", _ratio(row["vs_torch"])]
        + ([_ratio(row["vs_dali"])] if with_dali else [])
        for row in rows
    ]
    lines = [
        "The training pipeline (random-resized crop 224 + flip, uint8 CHW batches of "
        f"{config.get('batch_size', '?')}, {config.get('workers_or_threads', 2)} workers or "
        f"threads each, {config.get('photos', '?')} photos):",
        "",
        _aligned(header, table),
        "",
        f"samples/s: steady, median of {config.get('rounds', '?')} interleaved rounds; ratios: "
        "medians of the per-round ratios (higher is better)",
    ]
    for name, why in (result.get("peers_skipped") or {}).items():
        lines.append(f"{name} skipped: {why}")
    return "\n".join(lines)


_TRANSPORT_KINDS = {
    "pose64": "pose HDF5 fields, batch 64",
    "pose256": "pose HDF5 fields, batch 256",
    "tokens": "2048-token windows, batch 32",
    "index": "an index, batch 256",
    "images": "3x224x224 uint8, batch 64",
}


def transport_summary(result: dict) -> str:
    """Batches from workers to the main process: each data kind, fastloader vs torch, with
    the main process's CPU per batch (issue 30's table)."""
    rows = result.get("rows") or []
    if not rows:
        return ""
    header = ["data", "workers", "samples/s", "x torch", "main CPU ms/batch", "torch's"]
    table = [
        [
            _TRANSPORT_KINDS.get(row["data"], row["data"]),
            str(row["num_workers"]),
            f"{row['fastloader_samples_per_s']:.0f}",
            _ratio(row["vs_torch"]),
            f"{row['fastloader_main_cpu_ms_per_batch']:.2f}",
            f"{row['torch_main_cpu_ms_per_batch']:.2f}",
        ]
        for row in rows
    ]
    ratios = result.get("ratios", {})
    config = result.get("config", {})
    rounds = config.get("rounds", "?")
    in_process = config.get("rounds_in_process", rounds)
    lines = [
        "Batches from workers to the main process (fastloader vs torch's DataLoader, "
        "persistent workers; 0 workers: in the main process):",
        "",
        _aligned(header, table),
        "",
        f"ratios: medians of {rounds} interleaved rounds' ratios ({in_process} without workers; "
        "higher is better); main CPU: the main process's CPU time per batch, what a GPU step "
        "loses to loading",
    ]
    if any(row["num_workers"] == 0 for row in rows):
        lines.append(
            "0 workers: both loaders make the batches in the main process; pose is faster "
            "there because fastloader reads a batch's rows in one __getitems__ call (torch: one "
            "sample at a time); the rest is the same work (fastloader also seeds every sample)"
        )
    in_process = ratios.get("pose64_2w_vs_fastloader_0w")
    plain = ratios.get("pose64_0w_vs_plain_loop")
    if in_process is not None and plain is not None:
        lines.append(
            f"pose, batch 64: 2 workers give {_ratio(in_process)} of fastloader's in-process "
            f"rate (in the same rounds); in-process, {_ratio(plain)} of a plain __getitems__ + "
            "collate loop"
        )
    lines += _why_short_epochs_travel_singly(in_process, config)
    return "\n".join(lines)


def _why_short_epochs_travel_singly(in_process: float | None, config: dict) -> list[str]:
    """The line that explains workers slower than the main process on short epochs of cheap
    batches: groups start only at batch DECIDE_AT of each epoch."""
    from fastloader.loader.transport.groups import DECIDE_AT

    sizes = config.get("sizes") or ()
    batches = sizes[1] // 64 if len(sizes) > 1 else None  # pose samples, batch 64
    if in_process is None or in_process >= 1 or batches is None or batches >= 4 * DECIDE_AT:
        return []
    return [
        f"why 2 workers are slower than the main process here: an epoch is {batches} batches, "
        f"and cheap batches travel several to a message only from batch {DECIDE_AT} of each "
        "epoch on (NOTE [ Batches per message ] in fastloader/loader/transport/groups.py), so "
        "this short epoch goes mostly one batch a message; the full run's longer epochs "
        "(README, transport rows) measure the grouped rate"
    ]


def _summary_head(results: dict) -> list[str]:
    """The summary's first line (size, seconds, load) and the demo's thread note."""
    load = results["machine"].get("load_average")
    lines = [
        f"fastloader benchmarks, size {results['size']} ({results.get('seconds', 0):.0f} s"
        + (f"; load average {load} at the start" if load else "")
        + ")"
    ]
    if results["machine"].get("main_process_torch_threads") == 1:  # benchmarks/__main__.py:
        lines.append(  # NOTE [ One intra-op thread in the demo ]
            "the main process ran torch on 1 intra-op thread, as the workers do: with 2, on a "
            "busy machine, its copies (0 workers) waited on each other and the ratios were noise"
        )
    return lines


def _other_lines(name: str, result: dict) -> list[str]:
    """A comparison without a table of its own in the summary: its ratios, a small table."""
    if result.get("skipped"):
        return [f"  {name}: skipped: {result['skipped']}"]
    if result.get("error"):
        return [f"  {name}: ERROR: {result['error'].strip().splitlines()[-1]}"]
    ratios = [
        f"{key.replace('_', ' ')} {format_value(_ratio_key(key), value)}"
        for key, value in result.get("ratios", {}).items()
    ]
    if result.get("peer_skipped"):
        ratios.append(f"peer skipped: {result['peer_skipped']}")
    lines = [f"  {name}: " + ("; ".join(ratios) or "done")]
    rows = result.get("rows") or []
    if 0 < len(rows) <= _SMALL_TABLE and len(_columns(rows)) <= _SMALL_TABLE:
        lines += ["    " + line for line in format_table(rows).splitlines()]
    return lines


def summary(results: dict, out: Path, plots: list[Path]) -> str:
    """What a person reads at the end of a run: the training pipeline (the headline), the
    transport and loader tables, each other comparison's ratios in one line or two, where the
    results went."""
    comparisons = results["comparisons"]
    lines = _summary_head(results)
    shown = []
    shown_first = (
        ("pipeline", pipeline_summary),
        ("transport", transport_summary),
        ("loader", loader_summary),
    )
    for name, render_one in shown_first:
        result = comparisons.get(name)
        if result and not result.get("skipped") and not result.get("error"):
            text = render_one(result)
            if text:
                lines += ["", text]
                shown.append(name)
    others = [name for name in comparisons if name not in shown]
    if others:
        lines += ["", "other comparisons (ratios; the tables are in results.md):"]
    for name in others:
        lines += _other_lines(name, comparisons[name])
    written = [out / "results.md", out / "results.json", *plots]
    lines += [
        "",
        "full results: " + ", ".join(str(path) for path in written),
        f"these numbers are this machine's at size {results['size']}. " + _readme_source(),
    ]
    return "\n".join(lines)
