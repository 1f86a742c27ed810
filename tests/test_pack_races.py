"""The end of a pack: racing packers never silently replace each other's DST, --overwrite says
when it replaced a DST that changed during the run, and a full disk is one clear line with no
file left behind."""

import errno
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastloader import open_pack
from fastloader.cli import main
from fastloader.packing import output as _pack_output
from fastloader.packing.pack import pack

pack_module = importlib.import_module("fastloader.packing.pack")


def _folder(root: Path, count: int, size: int = 16, noise: bool = False) -> Path:
    rng = np.random.default_rng(count)
    for index in range(count):
        folder = root / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        if not noise:
            pixels[:] = index
        Image.fromarray(pixels).save(folder / f"{index:04d}.png")
    return root


def _count(path: Path) -> int:
    dataset = open_pack(path)
    try:
        return len(dataset)
    finally:
        dataset.close()


def _partials(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".partial-" in name)


# Runs the real CLI; pack()'s writer waits until both racers have their partial file (so both
# passed the check that DST does not exist) before it writes: the race is certain, not timed.
_RACER = textwrap.dedent(
    """
    import importlib, os, sys, time
    from fastloader.cli import main

    pack_module = importlib.import_module("fastloader.packing.pack")

    target = sys.argv[2]
    folder, name = os.path.dirname(target), os.path.basename(target)
    opened = pack_module.open_writer

    def open_after_both(*args, **kwargs):
        writer = opened(*args, **kwargs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(n.startswith(f".{name}.partial-") for n in os.listdir(folder)) >= 2:
                break
            time.sleep(0.01)
        return writer

    pack_module.open_writer = open_after_both
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_two_packers_racing_for_one_dst_one_wins_the_other_fails_cleanly(tmp_path, suffix):
    sources = [_folder(tmp_path / "a", 6), _folder(tmp_path / "b", 9)]
    target = tmp_path / f"out{suffix}"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(source), str(target), "--workers", "0", "-q"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source in sources
    ]
    results = [racer.communicate(timeout=120) + (racer.returncode,) for racer in racers]
    codes = sorted(code for _, _, code in results)
    assert codes == [0, 1], results
    (winner,) = [i for i, (_, _, code) in enumerate(results) if code == 0]
    _, loser_err, _ = results[1 - winner]
    lines = loser_err.strip().splitlines()
    assert len(lines) == 1, loser_err
    assert "appeared while packing" in lines[0] and "--overwrite" in lines[0]
    assert _count(target) == (6, 9)[winner]  # the winner's pack, complete
    assert _partials(tmp_path) == []


def test_overwrite_replaces_a_dst_that_appeared_during_the_run_and_says_so(
    tmp_path, monkeypatch, capsys
):
    source = _folder(tmp_path / "src", 4)
    target = tmp_path / "out.lmdb"
    pack(_folder(tmp_path / "other", 2), target, workers=0)
    opened = _pack_output.publish

    def publish_after_another_run(partial, dst, overwrite, seen):
        target.unlink()  # another run rewrites DST meanwhile
        third = _folder(tmp_path / "third", 6)
        command = "import sys; from fastloader import pack; pack(sys.argv[1], sys.argv[2])"
        subprocess.run([sys.executable, "-c", command, str(third), str(target)], check=True)
        return opened(partial, dst, overwrite, seen)

    monkeypatch.setattr(pack_module, "publish", publish_after_another_run)
    assert main([str(source), str(target), "--workers", "0", "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert f"replaced {target}, which changed while this run packed (--overwrite)" in err
    assert _count(target) == 4


def test_overwrite_of_an_unchanged_dst_says_nothing(tmp_path, capsys):
    source = _folder(tmp_path / "src", 4)
    target = tmp_path / "out.h5"
    pack(source, target, workers=0)
    assert main([str(source), str(target), "--workers", "0", "--overwrite"]) == 0
    assert "replaced" not in capsys.readouterr().err


@pytest.mark.parametrize("fallback", ["link", "flock"])
def test_no_replace_fallbacks_refuse_an_existing_dst(tmp_path, monkeypatch, fallback):
    """Where renameat2 is missing (old libc, some file systems), or hard links too."""
    monkeypatch.setattr(_pack_output, "_renameat2", lambda source, target: False)
    if fallback == "flock":

        def no_links(source, target):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(_pack_output.os, "link", no_links)
    partial, target = tmp_path / ".x.partial", tmp_path / "x"
    partial.write_bytes(b"new")
    target.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        _pack_output.rename_noreplace(partial, target)
    assert target.read_bytes() == b"old" and partial.exists()
    target.unlink()
    _pack_output.rename_noreplace(partial, target)
    assert target.read_bytes() == b"new" and not partial.exists()


def test_renameat2_refuses_to_replace(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    partial, target = tmp_path / "a", tmp_path / "b"
    partial.write_bytes(b"new")
    target.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        _pack_output._renameat2(partial, target)
    target.unlink()
    assert _pack_output._renameat2(partial, target) is True
    assert target.read_bytes() == b"new"


# --- disk full ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and mount); skipped where it cannot be made."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root on Linux")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {made.stderr.decode(errors='replace').strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _pack_in_a_process(start: list, source, target, *options: str) -> subprocess.CompletedProcess:
    """``fastloader-pack SOURCE TARGET --workers 0 OPTIONS`` in a Python started with ``start``
    (``-m fastloader.cli``, or a ``-c`` script that runs it), its output captured as text."""
    command = [sys.executable, *start, str(source), str(target), "--workers", "0", *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_a_full_disk_is_one_line_naming_the_disk_and_the_space_needed(tmp_path, small_disk, suffix):
    source = _folder(tmp_path / "src", 40, size=128, noise=True)  # ~2 MiB of raw pixels
    target = small_disk / f"out{suffix}"
    process = _pack_in_a_process(["-m", "fastloader.cli"], source, target, "--store", "raw", "-q")
    assert process.returncode == 1, process.stderr
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert f"no space left on {small_disk} (tmpfs)" in lines[0]
    assert "the pack needs more than" in lines[0] and "MiB" in lines[0]
    assert "Traceback" not in process.stderr
    assert os.listdir(small_disk) == []  # no partial file


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_a_disk_full_before_the_first_record_is_one_line_too(tmp_path, small_disk, suffix):
    source = _folder(tmp_path / "src", 2)
    (small_disk / "filler").write_bytes(b"x" * (1 << 20))  # as much as fits
    target = small_disk / f"out{suffix}"
    process = _pack_in_a_process(["-m", "fastloader.cli"], source, target)
    assert process.returncode == 1
    assert process.stderr.strip().splitlines() == [
        f"fastloader-pack: error: {target}: no space left on {small_disk} (tmpfs): it is full, "
        "0 B were free at the start; free some space there or write DST elsewhere"
    ]
    assert os.listdir(small_disk) == ["filler"]


def test_a_file_size_limit_is_one_line_and_leaves_no_file(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_FSIZE as on Linux")
    source = _folder(tmp_path / "src", 40, size=128, noise=True)
    target = tmp_path / "out.h5"
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from fastloader.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    process = _pack_in_a_process(["-c", script], source, target, "--store", "raw", "-q")
    assert process.returncode == 1, process.stderr
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1 and "grew past the largest file allowed" in lines[0], process.stderr
    assert _partials(tmp_path) == [] and not target.exists()


def test_a_real_io_error_with_room_to_spare_is_not_called_a_full_disk(tmp_path):
    error = OSError(errno.EIO, "Input/output error")
    assert _pack_output.storage_error(error, tmp_path / "x.lmdb", 10, 1, 5, None) is None
