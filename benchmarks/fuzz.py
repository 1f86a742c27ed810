"""Damaged packs: byte flips and truncations, each read in a subprocess that may crash.

Reproduces the table of issue 10: for each backend x store, copies of a small pack get random
damage (3 flipped bytes, or a truncation), every sample is read, and each trial is one of

- ``correct or PackError``: every sample read is identical to the original, or PackError;
- ``silently wrong``: a sample, label, class list or length differs, without an error;
- ``other exception``: an exception other than PackError (or FileNotFoundError) escaped;
- ``crashed``: the reading process died (a signal such as SIGBUS/SIGSEGV) or hung.

Reads run in a child process (``python -m benchmarks.fuzz --child``) fed one damaged file per
line; when it dies, the trial it was on is counted as crashed and a fresh child takes the rest.
tests/test_pack_fuzz.py runs a bounded version of this in CI.

Run: ``python -m benchmarks.fuzz [--trials 80] [--seed 0] [--photos]`` (not part of
``python -m benchmarks``).

``--scan-data`` fuzzes JPEG files instead of packs: each trial damages only the entropy-coded
scan data of a photo (random byte flips, or a stray marker written into it; the end marker
stays), then decodes it through the fused path with crops of every kind (random crops at full
scale, the kind earlier versions decoded as a region; DCT-scaled crops; the whole image), many
seeds each, and compares with torchvision's path (Pillow's full decode, then the same
transform). A trial is ``silently wrong`` if any crop gives pixels where Pillow raises, or
pixels far from Pillow's (PSNR < 30 dB) where Pillow decodes; ``other exception`` if the error
is not an OSError or a DecompressionBombError; ``crashed`` or ``hung`` if the child died or
took over 60 s.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash
from PIL import Image

OUTCOMES = ("correct or PackError", "silently wrong", "other exception", "crashed")
BACKENDS = {"lmdb": ".lmdb", "hdf5": ".h5"}
STORES = ("raw", "encoded")
CLASSES = ["a", "b", "c"]
_NO_CHECKSUMS = "FASTLOADER_FUZZ_NO_CHECKSUMS"  # "1": read with verify_checksums=False


def _pixels(index: int) -> np.ndarray:
    rng = np.random.default_rng(index)
    height, width = 4 + 8 * (index % 5), 32  # 384 B to 3.4 KB: inline and overflow in LMDB
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 7 + index, y * 9, (x + y) * 3], axis=2) % 256
    return np.clip(base + rng.integers(-8, 8, base.shape), 0, 255).astype(np.uint8)


def make_pack(path: Path, backend: str, store: str, count: int = 12) -> Path:
    """Write a small pack: ``raw`` pixels, or ``encoded`` PNG and JPEG files; with sources."""
    from fastloader.formats import RecordKind, encode_record, open_writer

    with open_writer(path, backend, store=store, classes=CLASSES, info={"n": count}) as writer:
        for index in range(count):
            label, pixels = index % len(CLASSES), _pixels(index)
            if store == "raw":
                record = encode_record(pixels, label, RecordKind.RAW)
            else:
                buffer = io.BytesIO()
                Image.fromarray(pixels).save(buffer, "JPEG" if index % 2 else "PNG", quality=90)
                record = encode_record(buffer.getvalue(), label, RecordKind.ENCODED)
            writer.append(record, label, f"{CLASSES[label]}/img{index}.png")
    return path


def read_all(path: str) -> dict:
    """Read everything a user reads from the pack at ``path``; a summary to compare."""
    from fastloader import PackError, open_pack

    result: dict = {}
    try:
        checksums = os.environ.get(_NO_CHECKSUMS) != "1"
        dataset = open_pack(path, decode="numpy", verify_checksums=checksums)
    except (PackError, FileNotFoundError):
        return {"open": "PackError"}
    except Exception as error:  # noqa: BLE001 - what we are looking for
        return {"open": f"other: {type(error).__name__}: {error}"[:300]}
    result["open"] = "ok"
    result["length"] = len(dataset)
    result["classes"] = list(dataset.classes)
    samples = []
    for index in range(len(dataset)):
        try:
            pixels, label = dataset[index]
            source = dataset.source_path(index)
            digest = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(pixels).tobytes())
            samples.append([int(label), digest, list(pixels.shape), source])
        except PackError:
            samples.append("PackError")
        except Exception as error:  # noqa: BLE001
            samples.append(f"other: {type(error).__name__}: {error}"[:300])
    result["samples"] = samples
    return result


def classify(expected: dict, got: dict | None) -> str:
    """The outcome of one trial (see the module docstring); ``got`` None: the child died."""
    if got is None:
        return "crashed"
    if got["open"] != "ok":
        return "correct or PackError" if got["open"] == "PackError" else "other exception"
    if got["length"] != expected["length"] or got["classes"] != expected["classes"]:
        return "silently wrong"
    outcome = "correct or PackError"
    for want, have in zip(expected["samples"], got["samples"], strict=True):
        if isinstance(have, str) and have.startswith("other"):
            return "other exception"
        if have != "PackError" and have != want:
            outcome = "silently wrong"
    return outcome


def damage(data: bytes, rng: np.random.Generator, kind: str, flips: int = 3) -> bytes:
    """``flips`` random bytes changed (kind "flip"), or cut at a random length ("truncate")."""
    if kind == "truncate":
        return data[: int(rng.integers(0, len(data)))]
    damaged = bytearray(data)
    for position in rng.choice(len(data), size=flips, replace=False):
        damaged[position] ^= int(rng.integers(1, 256))
    return bytes(damaged)


def run_trials(
    paths: list[Path],
    timeout: float = 60.0,
    module_args: tuple[str, ...] = ("benchmarks.fuzz", "--child"),
) -> list[dict | None]:
    """Read each file in a child process (``python -m *module_args``, paths on its stdin, a
    JSON line each on its stdout); None for those it crashed (or hung) on."""
    results: list[dict | None] = []
    env = {**os.environ, "PYTHONFAULTHANDLER": ""}
    while len(results) < len(paths):
        rest = paths[len(results) :]
        child = subprocess.Popen(
            [sys.executable, "-m", *module_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            out, _ = child.communicate("\n".join(map(str, rest)) + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results += lines
        if len(lines) < len(rest):
            results.append(None)  # the child died (or hung) on the next file
    return results[: len(paths)]


def make_photo_pack(path: Path, store: str, workdir: Path, count: int = 24) -> Path:
    """A pack made by ``fastloader.pack`` from the benchmark suite's photos (real JPEGs)."""
    from benchmarks._photos import image_folder
    from fastloader import pack

    folder = image_folder(workdir, count)
    pack(folder, path, store=store, short_side=None if store == "encoded" else 64, workers=0)
    return path


def fuzz(
    workdir: Path, backend: str, store: str, trials: int, kind: str, seed: int, photos: bool
) -> dict[str, int]:
    """Count the outcomes of ``trials`` damaged copies of one small pack."""
    original = workdir / f"orig-{store}-{photos}{BACKENDS[backend]}"
    if not original.exists() and photos:
        make_photo_pack(original, store, workdir)
    elif not original.exists():
        make_pack(original, backend, store)
    expected = read_all(str(original))
    data = original.read_bytes()
    rng = np.random.default_rng(seed)
    paths = []
    for trial in range(trials):
        path = workdir / f"{kind}-{store}-{trial}{BACKENDS[backend]}"
        path.write_bytes(damage(data, rng, kind))
        paths.append(path)
    counts = dict.fromkeys(OUTCOMES, 0)
    for result in run_trials(paths):
        counts[classify(expected, result)] += 1
    return counts


# --- damaged scan data, through the fused path (--scan-data) ---------------------------------

SCAN_OUTCOMES = ("same as torch", "silently wrong", "other exception", "crashed", "hung")
SCAN_SEEDS = 12


def _crop_kinds() -> dict:
    from fastloader import transforms as T

    return {  # on 320x240 and 640x480 photos
        "full-scale random crop": T.Compose([T.RandomResizedCrop(96), T.RandomHorizontalFlip()]),
        "DCT-scaled": T.Compose([T.Resize(64), T.CenterCrop(56)]),
        "whole image": T.Compose([T.Resize(240)]),
    }


def scan_photos() -> list[bytes]:
    """Four JPEGs of the benchmark photos: baseline and progressive, 320x240 and 640x480."""
    from benchmarks._photos import source_photos

    photos = list(source_photos()[1].values())
    out = []
    for index, (width, height, progressive) in enumerate(
        [(320, 240, False), (320, 240, True), (640, 480, False), (640, 480, True)]
    ):
        image = Image.fromarray(photos[index % len(photos)]).convert("RGB")
        buffer = io.BytesIO()
        image.resize((width, height)).save(buffer, "JPEG", quality=90, progressive=progressive)
        out.append(buffer.getvalue())
    return out


def damage_scan_data(data: bytes, rng: np.random.Generator) -> bytes:
    """``data`` with its entropy-coded data damaged, the headers and end marker intact."""
    start = data.find(b"\xff\xda") + 4
    end = len(data) - 2
    damaged = bytearray(data)
    if rng.random() < 0.5:
        for position in rng.integers(start + 16, end, size=int(rng.integers(1, 6))):
            damaged[position] ^= int(rng.integers(1, 256))
    else:
        position = int(rng.integers(start + 16, end - 2))
        damaged[position : position + 2] = bytes([0xFF, int(rng.choice([0xC0, 0xD8, 0xDB, 0xC4]))])
    return bytes(damaged)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * float(np.log10(255**2 / mse))


def judge_scan_damage(path: str) -> str:
    """Decode one damaged JPEG on every crop kind and seed; the trial's outcome."""
    import torch

    from fastloader.vision.decoding import fuse

    data = Path(path).read_bytes()

    def plain() -> Image.Image:
        return Image.open(io.BytesIO(data)).convert("RGB")

    try:
        reference = plain()
    except OSError:
        reference = None
    outcome = "same as torch"
    for transform in _crop_kinds().values():
        fused = fuse(transform)
        for seed in range(SCAN_SEEDS):
            torch.manual_seed(seed)
            try:
                got = np.asarray(fused.apply_encoded(data, plain, "numpy"))
            except OSError:
                if reference is not None:
                    return "other exception"  # refused a file Pillow loads
                continue
            except Exception:  # noqa: BLE001 - what we are looking for
                return "other exception"
            if reference is None:
                return "silently wrong"
            torch.manual_seed(seed)
            want = np.asarray(transform(reference))
            if _psnr(got.reshape(want.shape), want) < 30:
                outcome = "silently wrong"
    return outcome


def run_scan_trials(paths: list[Path], timeout: float = 60.0) -> list[str]:
    """Judge each file in a child process; "crashed"/"hung" for the one a child died on."""
    results: list[str] = []
    while len(results) < len(paths):
        rest = paths[len(results) :]
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fuzz", "--scan-child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        hung = False
        try:
            out, _ = child.communicate("\n".join(map(str, rest)) + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
            hung = True
        lines = [json.loads(line) for line in out.splitlines() if line.startswith('"')]
        results += lines
        if len(lines) < len(rest):
            results.append("hung" if hung else "crashed")
    return results[: len(paths)]


def fuzz_scan_data(workdir: Path, trials: int, seed: int) -> dict[str, int]:
    """Count the outcomes of ``trials`` JPEGs with damaged scan data."""
    rng = np.random.default_rng(seed)
    photos = scan_photos()
    paths = []
    for trial in range(trials):
        path = workdir / f"scan-{trial}.jpg"
        path.write_bytes(damage_scan_data(photos[trial % len(photos)], rng))
        paths.append(path)
    counts = dict.fromkeys(SCAN_OUTCOMES, 0)
    for outcome in run_scan_trials(paths, timeout=60.0 + trials):
        counts[outcome] += 1
    return counts


CRASH_FOR_TEST = ".crash-for-test"  # a path naming this makes the child die, as a crash would


def _child() -> None:
    for line in sys.stdin:
        if CRASH_FOR_TEST in line:
            os.kill(os.getpid(), signal.SIGBUS)
        if line.strip():
            print(json.dumps(read_all(line.strip())), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scan-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--scan-data",
        action="store_true",
        help="fuzz JPEG scan data through the fused path (every crop kind) instead of packs",
    )
    parser.add_argument("--trials", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="flip,truncate")
    parser.add_argument(
        "--photos",
        action="store_true",
        help="packs of real photos made by pack() (default: "
        "small synthetic packs of PNG/JPEG/raw records of 384 B to 3.4 KB)",
    )
    parser.add_argument(
        "--no-checksums",
        action="store_true",
        help="read with verify_checksums=False: what the record checksums catch",
    )
    args = parser.parse_args(argv)
    if args.no_checksums:
        os.environ[_NO_CHECKSUMS] = "1"
    if args.child:
        _child()
        return
    if args.scan_child:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(judge_scan_damage(line.strip())), flush=True)
        return
    if args.scan_data:
        print("| damage | trials | " + " | ".join(SCAN_OUTCOMES) + " |")
        print("|---|---|" + "---|" * len(SCAN_OUTCOMES))
        with tempfile.TemporaryDirectory() as workdir:
            started = time.perf_counter()
            counts = fuzz_scan_data(Path(workdir), args.trials, args.seed)
            cells = " | ".join(str(counts[name]) for name in SCAN_OUTCOMES)
            print(
                f"| JPEG scan data: byte flips or a stray marker, {SCAN_SEEDS} seeds x "
                f"{len(_crop_kinds())} crop kinds each | {args.trials} | {cells} |"
                f"  ({time.perf_counter() - started:.0f} s)"
            )
        return
    print("| pack | damage | trials | " + " | ".join(OUTCOMES) + " |")
    print("|---|---|---|" + "---|" * len(OUTCOMES))
    with tempfile.TemporaryDirectory() as workdir:
        for backend in BACKENDS:
            for store in STORES:
                for kind in args.kinds.split(","):
                    started = time.perf_counter()
                    counts = fuzz(
                        Path(workdir), backend, store, args.trials, kind, args.seed, args.photos
                    )
                    cells = " | ".join(str(counts[name]) for name in OUTCOMES)
                    what = "3 random byte flips" if kind == "flip" else "truncation"
                    print(
                        f"| {backend.upper()} {store} | {what} | {args.trials} | {cells} |"
                        f"  ({time.perf_counter() - started:.0f} s)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
