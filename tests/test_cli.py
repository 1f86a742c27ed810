"""fastloader-pack: the command line over fastloader.pack (most tests call main() directly)."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _images import EXPECTED_ORDER, make_folder_with_bad_files, make_image_folder

from fastloader import open_pack, read_metadata
from fastloader.cli import main

pack_worker = importlib.import_module("fastloader._pack_worker")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images") / "src")


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    return make_folder_with_bad_files(tmp_path_factory.mktemp("bad") / "src")


def one_error_line(capsys) -> str:
    """The stderr of a failed run: exactly one line, our prefix, no traceback."""
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fastloader-pack: error: ")
    return err


def test_packs_a_folder_and_prints_a_summary(folder, tmp_path, capsys):
    assert main([str(folder), str(tmp_path / "out.lmdb"), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"packed 13 images of 3 classes into {tmp_path / 'out.lmdb'} (lmdb, ")
    assert open_pack(tmp_path / "out.lmdb").targets.tolist() == [y for _, y in EXPECTED_ORDER]


def test_store_options_reach_the_pack(folder, tmp_path):
    target = tmp_path / "out.hdf5"
    args = [str(folder), str(target), "--store", "jpeg", "--quality", "70", "--max-side", "16"]
    assert main([*args, "--workers", "0", "--quiet"]) == 0
    metadata = read_metadata(target)
    assert (metadata["backend"], metadata["store"]) == ("hdf5", "jpeg")
    assert (metadata["info"]["quality"], metadata["info"]["max_side"]) == (70, 16)
    assert open_pack(target)[0][0].size == (16, 12)
    target = tmp_path / "short.lmdb"
    assert main([str(folder), str(target), "--store", "raw", "--short-side", "6", "-q"]) == 0
    assert open_pack(target)[0][0].size == (8, 6)


def test_format_option_overrides_the_suffix(folder, tmp_path, capsys):
    assert main([str(folder), str(tmp_path / "out.pack")]) == 1
    assert "cannot tell the format" in one_error_line(capsys)
    assert main([str(folder), str(tmp_path / "out.pack"), "--format", "lmdb", "-q"]) == 0
    assert read_metadata(tmp_path / "out.pack")["backend"] == "lmdb"


def test_quiet_prints_nothing_on_success(folder, tmp_path, capsys):
    assert main([str(folder), str(tmp_path / "out.lmdb"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_bad_files_are_listed_in_the_summary(bad_folder, tmp_path, capsys):
    assert main([str(bad_folder), str(tmp_path / "out.lmdb"), "--store", "raw"]) == 0
    out = capsys.readouterr().out
    assert "skipped 3 unreadable:" in out
    assert f"{bad_folder / 'b/text.jpg'}: not an image file Pillow can read" in out
    assert f"{bad_folder / 'b/empty.png'}: empty file" in out


def test_strict_fails_with_no_output_file(bad_folder, tmp_path, capsys):
    assert main([str(bad_folder), str(tmp_path / "out.lmdb"), "--strict"]) == 1
    assert "empty.png: empty file" in one_error_line(capsys)
    assert os.listdir(tmp_path) == []


def test_an_existing_pack_is_replaced_only_with_overwrite(folder, tmp_path, capsys):
    target = tmp_path / "out.lmdb"
    target.write_bytes(b"old")
    assert main([str(folder), str(target)]) == 1
    assert "already exists" in one_error_line(capsys)
    assert target.read_bytes() == b"old"
    assert main([str(folder), str(target), "--overwrite"]) == 0
    assert len(open_pack(target)) == 13


def _empty_class(tmp_path: Path) -> Path:
    (tmp_path / "src/a").mkdir(parents=True)
    (tmp_path / "src/b").mkdir()
    (tmp_path / "src/a/x.txt").write_text("not an image")
    return tmp_path / "src"


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        (lambda tmp, folder: tmp / "missing", "out.lmdb", "missing: no such folder"),
        (lambda tmp, folder: (tmp / "e").mkdir() or tmp / "e", "out.lmdb", "no class folders"),
        (lambda tmp, folder: _empty_class(tmp), "out.lmdb", "no image file for the classes a, b"),
        (lambda tmp, folder: folder, "nowhere/out.lmdb", "nowhere: no such folder"),
        (lambda tmp, folder: folder, "src.txt/out.lmdb", "src.txt: not a folder"),
    ],
    ids=["missing-src", "empty-src", "empty-classes", "missing-dst-folder", "dst-folder-is-file"],
)
def test_bad_source_or_target_exits_1_with_one_line(
    folder, tmp_path, capsys, source, target, message
):
    (tmp_path / "src.txt").write_text("a file")
    assert main([str(source(tmp_path, folder)), str(tmp_path / target)]) == 1
    assert message in one_error_line(capsys)
    assert not any(".partial-" in name for name in os.listdir(tmp_path))


def test_a_read_only_target_folder_exits_1(folder, tmp_path, capsys, monkeypatch):
    (tmp_path / "ro").mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: pretend it may not
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main([str(folder), str(tmp_path / "ro/out.lmdb")]) == 1
    assert "ro: no permission to write out.lmdb there" in one_error_line(capsys)
    assert os.listdir(tmp_path / "ro") == []


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["only-src"],
        ["s", "d.lmdb", "--quality", "50"],
        ["s", "d.lmdb", "--store", "jpeg", "--quality", "101"],
        ["s", "d.lmdb", "--max-side", "64"],
        ["s", "d.lmdb", "--store", "raw", "--short-side", "0"],
        ["s", "d.lmdb", "--store", "png"],
        ["s", "d.lmdb", "--workers", "many"],
        ["--info", "x.lmdb", "extra"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage: fastloader-pack" in capsys.readouterr().err


def test_keyboard_interrupt_exits_130_and_leaves_no_file(folder, tmp_path, capsys, monkeypatch):
    calls = []
    encode_file = pack_worker.encode_file

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return encode_file(*args)

    monkeypatch.setattr(pack_worker, "encode_file", interrupted)
    target = tmp_path / "out.lmdb"
    assert main([str(folder), str(target), "--workers", "0"]) == 130
    assert capsys.readouterr().err == "fastloader-pack: interrupted\n"
    assert os.listdir(tmp_path) == []


def test_info_describes_a_pack(folder, tmp_path, capsys):
    target = tmp_path / "out.lmdb"
    assert main([str(folder), str(target), "--store", "raw", "-q"]) == 0
    assert main(["--info", str(target)]) == 0
    out = capsys.readouterr().out
    for line in [
        f"path:     {target}",
        "backend:  lmdb (format version 2)",
        "store:    raw",
        "count:    13",
        "classes:  3 (Bird, cat, dog)",
        "  created_by: fastloader-pack",
        f"  source: {folder}",
    ]:
        assert line in out.splitlines()
    size = next(line for line in out.splitlines() if line.startswith("size:"))
    assert size.endswith("KiB")


@pytest.mark.parametrize(
    ("content", "name"), [(b"not a pack at all", "junk.lmdb"), (None, "missing.lmdb")]
)
def test_info_on_a_bad_file_exits_1_naming_it(tmp_path, capsys, content, name):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    assert main(["--info", str(tmp_path / name)]) == 1
    assert str(tmp_path / name) in one_error_line(capsys)


# --- the real console script -----------------------------------------------------------------


def _script() -> list[str]:
    found = shutil.which("fastloader-pack")
    return [found] if found else [sys.executable, "-m", "fastloader.cli"]


def test_console_script_packs_and_describes(folder, tmp_path):
    target = tmp_path / "out.h5"
    run = subprocess.run(
        [*_script(), str(folder), str(target), "--store", "raw", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "packed 13 images" in run.stdout and run.stderr == ""  # no bar: not a terminal
    pixels, label = open_pack(target, decode="numpy")[len(EXPECTED_ORDER) - 1]
    assert label == 2 and pixels.dtype == np.uint8
    info = subprocess.run(
        [sys.executable, "-m", "fastloader.cli", "--info", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert info.returncode == 0 and "backend:  hdf5" in info.stdout


def test_console_script_error_is_one_line_without_traceback(tmp_path):
    run = subprocess.run(
        [*_script(), str(tmp_path / "missing"), str(tmp_path / "out.lmdb")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stderr == f"fastloader-pack: error: {tmp_path / 'missing'}: no such folder\n"
