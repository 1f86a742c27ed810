"""Fused pixels against torchvision's: PSNR and time per image, on small and large photos.

For each photo and transform, the fused decode (``fastloader.vision.decoding``: DCT-scaled decode,
crop, resize, flip) is compared with the same transform applied the plain way, as torchvision
applies it: Pillow's full decode, then ``crop`` + Pillow's bilinear ``resize`` (same seeds, so
the same boxes and flips). Two transforms: the training one, ``RandomResizedCrop(224)`` + flip,
and the evaluation one, ``Resize(256)`` + ``CenterCrop(224)``.

Photos:
- small: the benchmark suite's ~500x375 JPEGs (random views of scikit-image's photos);
- large: every JPEG with a short side >= 1000 px under ``--large DIR`` (for instance the
  photos of Debian's wallpaper packages: ``apt-get download mate-backgrounds
  plasma-workspace-wallpapers lomiri-wallpapers`` then ``dpkg -x`` each into DIR); without it,
  scikit-image's photos upscaled 4x (bicubic) stand in, and the table says so.

Time: the median over photos and seeds of the fused call (``apply_encoded``, decode included),
one core; the median of ``--rounds`` rounds. Compare versions by running the script with each
checkout's ``fastloader`` first on the path, alternately.

``--baseline CHECKOUT`` adds another version's PSNR and the time ratio of this version to it,
each image timed with both, back to back in one process (robust to a busy machine).

Run: ``python -m benchmarks.fused_quality [--large DIR] [--baseline CHECKOUT] [--seeds 3]
[--rounds 3] [--json F]`` (not part of ``python -m benchmarks``).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

TRANSFORMS = ("RandomResizedCrop(224)+flip", "Resize(256)+CenterCrop(224)")


def _transforms(decoding: Any = None) -> dict:
    """The two transforms, from ``fastloader.vision.transforms`` (or a baseline's, next to
    ``decoding``)."""
    if decoding is None:
        from fastloader import transforms as T
    else:
        T = sys.modules[decoding.__name__.replace(".decoding", ".transforms")]  # noqa: N806

    return {
        TRANSFORMS[0]: T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()]),
        TRANSFORMS[1]: T.Compose([T.Resize(256), T.CenterCrop(224)]),
    }


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images, in dB (99 for identical ones)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * math.log10(255**2 / mse)


def small_photos(workdir: Path, count: int) -> list[Path]:
    """The benchmark suite's photos (~500x375 JPEGs)."""
    from benchmarks._photos import make_image_folder

    root = make_image_folder(workdir / "small", count)
    return sorted(root.glob("*/*.jpg"))


def large_photos(workdir: Path, folder: str | None) -> tuple[str, list[Path]]:
    """JPEGs with a short side >= 1000 px: from ``folder``, else scikit-image's upscaled."""
    if folder is not None:
        found = []
        for path in sorted(Path(folder).rglob("*")):
            if path.suffix.lower() not in (".jpg", ".jpeg") or not path.is_file():
                continue
            with Image.open(path) as image:
                if image.mode == "RGB" and min(image.size) >= 1000:
                    found.append(path)
        return f"{len(found)} JPEGs under {folder}", found
    from benchmarks._photos import source_photos

    out = workdir / "large"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, pixels in source_photos()[1].items():
        image = Image.fromarray(pixels).convert("RGB")
        image = image.resize((image.width * 4, image.height * 4), Image.BICUBIC)
        paths.append(out / f"{name}.jpg")
        image.save(paths[-1], quality=90)
    return f"{len(paths)} scikit-image photos upscaled 4x (bicubic)", paths


def measure_psnr(paths: list[Path], seeds: int, decoding: Any = None) -> dict[str, list[float]]:
    """PSNR of the fused output (of ``decoding``, default this version's) against
    torchvision's, per (photo, transform, seed)."""
    if decoding is None:
        from fastloader.vision import decoding

    scores: dict[str, list[float]] = {name: [] for name in TRANSFORMS}
    for path in paths:
        data = path.read_bytes()
        reference = Image.open(io.BytesIO(data)).convert("RGB")
        for name, transform in _transforms(decoding).items():
            fused = decoding.fuse(transform)
            for seed in range(seeds):
                torch.manual_seed(seed)
                want = np.asarray(transform(reference))
                torch.manual_seed(seed)
                got = fused.apply_encoded(data, reference.copy, "numpy")
                scores[name].append(psnr(np.asarray(got).reshape(want.shape), want))
    return scores


def measure_seconds(paths: list[Path], seeds: int) -> dict[str, float]:
    """The median time of the fused call (decode included) per image, per transform."""
    from fastloader.vision.decoding import fuse

    files = [path.read_bytes() for path in paths]
    times: dict[str, float] = {}
    for name, transform in _transforms().items():
        fused = fuse(transform)
        samples = []
        for data in files:
            for seed in range(seeds):
                torch.manual_seed(seed)
                started = time.perf_counter()
                fused.apply_encoded(data, _no_plain, "numpy")
                samples.append(time.perf_counter() - started)
        times[name] = float(np.median(samples))
    return times


def load_baseline(checkout: str, workdir: Path) -> Any:
    """The ``fastloader.vision.decoding`` of another checkout, imported as ``fastloader_baseline``
    (its imports rewritten), so both versions run in one process, image by image."""
    import importlib
    import re
    import shutil

    target = workdir / "fastloader_baseline"
    shutil.copytree(Path(checkout) / "fastloader", target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bfastloader\b(?=[.\s])", "fastloader_baseline", text))
    sys.path.insert(0, str(workdir))
    return importlib.import_module("fastloader_baseline.decoding")


def compare_seconds(paths: list[Path], seeds: int, baseline: Any) -> dict[str, float]:
    """Per transform: the median over images of (this version's time / the baseline's), each
    image timed with both versions back to back (alternating which goes first)."""
    from fastloader.vision.decoding import fuse

    files = [path.read_bytes() for path in paths]
    ratios: dict[str, float] = {}
    for (name, transform), (_, baseline_transform) in zip(
        _transforms().items(), _transforms(baseline).items(), strict=True
    ):
        pair = (fuse(transform), baseline.fuse(baseline_transform))
        per_image = []
        for index, data in enumerate(files):
            spent = [0.0, 0.0]
            for seed in range(seeds):
                for which in (0, 1) if (index + seed) % 2 == 0 else (1, 0):
                    torch.manual_seed(seed)
                    started = time.perf_counter()
                    pair[which].apply_encoded(data, _no_plain, "numpy")
                    spent[which] += time.perf_counter() - started
            per_image.append(spent[0] / spent[1])
        ratios[name] = float(np.median(per_image))
    return ratios


def _no_plain() -> None:
    raise AssertionError("the benchmark photos decode fused")


def summary(scores: list[float]) -> dict[str, float]:
    values = np.asarray(scores)
    return {
        "median": float(np.median(values)),
        "p10": float(np.percentile(values, 10)),
        "worst": float(values.min()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fused_quality")
    parser.add_argument("--large", help="a folder of large photos (JPEGs, searched recursively)")
    parser.add_argument("--small-count", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=3, help="crops per photo and transform")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (PSNR is fixed)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--baseline",
        help="another checkout (a folder holding fastloader/): add its PSNR and the time "
        "ratio of this version to it, image by image in one process",
    )
    args = parser.parse_args(argv)
    import cv2

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    results: dict = {"load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as workdir:
        sets = {
            "small": (
                f"{args.small_count} ~500x375",
                small_photos(Path(workdir), args.small_count),
            ),
            "large": large_photos(Path(workdir), args.large),
        }
        baseline = load_baseline(args.baseline, Path(workdir)) if args.baseline else None
        header = "| photos | transform | median dB | p10 dB | worst dB | ms per image |"
        if baseline is not None:
            header += " baseline: median / p10 / worst dB | time / baseline's |"
        print(header)
        print("|---|---|---:|---:|---:|---:|" + ("---:|---:|" if baseline else ""))
        for label, (what, paths) in sets.items():
            scores = measure_psnr(paths, args.seeds)
            rounds = [measure_seconds(paths, args.seeds) for _ in range(args.rounds)]
            if baseline is not None:
                before = measure_psnr(paths, args.seeds, baseline)
                ratio_rounds = [
                    compare_seconds(paths, args.seeds, baseline) for _ in range(args.rounds)
                ]
            for name in TRANSFORMS:
                row = summary(scores[name])
                row["ms"] = float(np.median([times[name] for times in rounds]) * 1e3)
                line = (
                    f"| {label}: {what} | {name} | {row['median']:.1f} | {row['p10']:.1f} | "
                    f"{row['worst']:.1f} | {row['ms']:.2f} |"
                )
                if baseline is not None:
                    row["baseline"] = summary(before[name])
                    row["time_ratio"] = float(np.median([r[name] for r in ratio_rounds]))
                    old = row["baseline"]
                    line += (
                        f" {old['median']:.1f} / {old['p10']:.1f} / {old['worst']:.1f} |"
                        f" {row['time_ratio']:.3f} |"
                    )
                results[f"{label}/{name}"] = {"photos": what, **row}
                print(line, flush=True)
    print(f"load average at start: {results['load']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
