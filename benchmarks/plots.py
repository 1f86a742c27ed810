"""The PNG plots of a suite run, each readable on its own: what is measured, which way is
better, loaders by their human names, ratios to the baseline on the bars, the spread over
rounds, and when and how loaded the machine was (its footer). Needs matplotlib; without it
:func:`write_plots` says the plots were skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._stats import paired_ratio

#: The loader comparison's loaders, as a reader knows them.
LOADER_NAMES = {
    "torch": "torch DataLoader (workers restarted each epoch)",
    "torch_persistent": "torch DataLoader, persistent_workers=True",
    "fastloader": "fastloader.DataLoader",
}
BASELINE_COLOUR, OURS_COLOUR, PEER_COLOUR = "tab:gray", "tab:blue", "tab:orange"


def loader_name(name: str) -> str:
    return LOADER_NAMES.get(name, name.replace("_", " "))


def footer(results: dict) -> str:
    """When and where: date, load average at the start (and end), CPUs, size."""
    machine = results.get("machine", {})
    parts = [str(machine.get("date", ""))[:16].replace("T", " ") + " UTC"]
    load = machine.get("load_average")
    if load is not None:
        end = machine.get("load_average_at_end")
        parts.append(f"load average {load}" + (f" → {end}" if end is not None else ""))
    if machine.get("usable_cpus"):
        parts.append(f"{machine['usable_cpus']} usable CPUs")
    parts.append(f"python -m benchmarks --size {results.get('size', '?')}")
    return " · ".join(part for part in parts if part.strip())


def _spread(rounds: list[float] | None, median: float) -> tuple[float, float]:
    """How far below and above ``median`` the rounds went (0, 0 without rounds)."""
    if not rounds:
        return 0.0, 0.0
    return max(median - min(rounds), 0.0), max(max(rounds) - median, 0.0)


def _bars(axis: Any, panel: dict) -> None:
    """Horizontal bars with min-max whiskers and ``1.23x <baseline>`` labels."""
    values, spreads = panel["values"], panel.get("spreads") or [(0.0, 0.0)] * len(panel["values"])
    errors = [[low for low, _ in spreads], [high for _, high in spreads]]
    errors = errors if any(map(any, spreads)) else None  # no rounds: no whiskers
    axis.barh(range(len(values)), values, color=panel["colours"], xerr=errors, capsize=3)
    axis.set_yticks(range(len(values)), panel["labels"], fontsize=8)
    axis.invert_yaxis()
    for index, (value, ratio) in enumerate(zip(values, panel["ratios"], strict=True)):
        if ratio is not None:
            text = f" {ratio:.2f}x {panel['baseline']}"
            axis.text(value + spreads[index][1], index, text, va="center", fontsize=8)
    axis.set_xlim(0, max(v + s[1] for v, s in zip(values, spreads, strict=True)) * 1.35)
    axis.set_xlabel(f"{panel['unit']}; higher is better")
    axis.set_title(panel["title"], fontsize=10)


def _colour(name: str, baseline: str) -> str:
    if name == baseline:
        return BASELINE_COLOUR
    if name.startswith("torch"):  # the other torch configuration: a baseline too
        return "silver"
    return OURS_COLOUR if "fastloader" in name or name.startswith(("lmdb", "hdf5")) else PEER_COLOUR


def pipeline_panel(result: dict) -> dict:
    rows, rounds = result["rows"], result.get("samples_per_s") or {}
    config = result.get("config", {})
    return {
        "title": "Training pipeline: random-resized crop 224 + flip, uint8 batches of "
        f"{config.get('batch_size', '?')}, {config.get('workers_or_threads', 2)} workers each",
        "unit": "samples/s, median of rounds (whiskers: slowest and fastest round)",
        "labels": [row.get("what") or row["loader"].replace("_", " ") for row in rows],
        "values": [row["samples_per_s"] for row in rows],
        "spreads": [_spread(rounds.get(row["loader"]), row["samples_per_s"]) for row in rows],
        "ratios": [row["vs_torch"] for row in rows],
        "baseline": "torch",
        "colours": [_colour(row["loader"], "torch_folder") for row in rows],
    }


def loader_panel(result: dict) -> dict:
    rows, rounds = result["rows"], result.get("throughput_samples_per_s") or {}
    base = {r["loader"]: r["steady_samples_per_s"] for r in rows}.get("torch_persistent")

    def ratio(row: dict) -> float | None:
        """As the printed table: the median of per-round ratios where there are rounds."""
        if row["loader"] in rounds and "torch_persistent" in rounds:
            return paired_ratio(rounds[row["loader"]], rounds["torch_persistent"])
        return row["steady_samples_per_s"] / base if base else None

    return {
        "title": "Steady throughput of decoded photos, no training step, 2 workers",
        "unit": "samples/s (whiskers: slowest and fastest epoch)",
        "labels": [loader_name(r["loader"]) for r in rows],
        "values": [r["steady_samples_per_s"] for r in rows],
        "spreads": [_spread(rounds.get(r["loader"]), r["steady_samples_per_s"]) for r in rows],
        "ratios": [ratio(r) for r in rows],
        "baseline": "torch persistent",
        "colours": [_colour(r["loader"], "torch_persistent") for r in rows],
    }


def _relative_panel(title: str, unit: str, rows: list[dict], key: str, spec: dict) -> dict:
    """A panel whose ratios are to ``spec["base"](row)``, the row it is measured against."""
    bases = [spec["base"](row) for row in rows]
    return {
        "title": title,
        "unit": unit,
        "labels": [spec["label"](row) for row in rows],
        "values": [row[key] for row in rows],
        "ratios": [
            row[key] / base[key] if base else None for row, base in zip(rows, bases, strict=True)
        ],
        "baseline": spec["baseline"],
        "colours": [
            BASELINE_COLOUR if base is row else OURS_COLOUR
            for row, base in zip(rows, bases, strict=True)
        ],
    }


def throughput_panels(comparisons: dict) -> list[dict]:
    """Each bar chart of throughput.png that has data."""
    panels = []
    formats = comparisons.get("formats", {}).get("rows") or []
    if formats:
        folder = next((r for r in formats if r["reader"] == "image folder"), None)
        spec = {
            "base": lambda row: folder,
            "baseline": "image folder",
            "label": lambda r: f"{r['reader']} {r['store']} ({r['decode']}, {r['loader']})",
        }
        title = "Reading 224x224 samples, 2 workers (formats)"
        panels.append(_relative_panel(title, "samples/s", formats, "samples_per_s", spec))
    packing = comparisons.get("packing", {})
    for key, title, unit, value in (
        ("rows", "Packing, 2 workers (packing)", "images/s", "images_per_s"),
        ("read_rows", "Reading back (packing)", "samples/s", "samples_per_s"),
    ):
        rows = packing.get(key) or []
        litdata = {row["store"]: row for row in rows if row["tool"] == "litdata"}
        spec = {
            "base": lambda row, litdata=litdata: litdata.get(row["store"]),
            "baseline": "litdata",
            "label": lambda r: " ".join(
                str(r[k]) for k in ("tool", "format", "store", "decode") if k in r
            ),
        }
        if rows:
            panels.append(_relative_panel(title, unit, rows, value, spec))
    loader = comparisons.get("loader", {})
    if loader.get("rows"):
        panels.append(loader_panel(loader))
    return panels


def _save(plt: Any, figure: Any, results: dict, path: Path) -> Path:
    figure.text(0.01, 0.005, footer(results), fontsize=7, color="dimgray", va="bottom")
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _first_batch_plot(plt: Any, results: dict, epochs: dict, path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, result in epochs.items():
        times = [seconds * 1e3 for seconds in result["first_batch_s"]]
        colour = _colour(name, "torch_persistent") if name != "torch" else "black"
        axis.plot(range(1, len(times) + 1), times, marker="o", label=loader_name(name), c=colour)
    axis.set_yscale("log")
    axis.set_xticks(range(1, 1 + max(len(r["first_batch_s"]) for r in epochs.values())))
    axis.set_xlabel("epoch")
    axis.set_ylabel("wait for the first batch (ms, log scale; lower is better)")
    axis.set_title("How long training waits at the start of each epoch (2 workers)", fontsize=10)
    axis.legend(fontsize=8)
    return _save(plt, figure, results, path)


def write_plots(results: dict, out: Path) -> tuple[list[Path], str | None]:
    """Write the PNG plots; return their paths and, if they were skipped, why."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed"
    written = []
    comparisons = results["comparisons"]
    pipeline = comparisons.get("pipeline", {})
    if pipeline.get("rows") and not pipeline.get("error"):
        panel = pipeline_panel(pipeline)
        figure, axis = plt.subplots(figsize=(9, 1.6 + 0.45 * len(panel["values"])))
        _bars(axis, panel)
        written.append(_save(plt, figure, results, out / "pipeline.png"))
    panels = throughput_panels(comparisons)
    if panels:
        height = 1.4 + 0.42 * sum(len(p["values"]) for p in panels) + 0.7 * len(panels)
        figure, axes = plt.subplots(len(panels), 1, figsize=(9, height), squeeze=False)
        for axis, panel in zip(axes[:, 0], panels, strict=True):
            _bars(axis, panel)
        written.append(_save(plt, figure, results, out / "throughput.png"))
    epochs = comparisons.get("loader", {}).get("epochs")
    if epochs:
        written.append(_first_batch_plot(plt, results, epochs, out / "first_batch.png"))
    return written, None
