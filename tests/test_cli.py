"""fastloader-pack: the command line over fastloader.pack (most tests call main() directly)."""

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _images import EXPECTED_ORDER, make_folder_with_bad_files, make_image_folder

from fastloader import open_pack, read_metadata
from fastloader import pack as pack_function
from fastloader.cli import main

pack_worker = importlib.import_module("fastloader.packing.worker")


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


SKIPPED_LINES = {
    "b/text.jpg": "not an image file Pillow can read",
    "b/empty.png": "empty file",
}


def skipped_lines(err: str, bad_folder: Path) -> dict[str, str]:
    """``{relative path: reason}`` of the ``skipped PATH: REASON`` lines of stderr."""
    prefix = f"fastloader-pack: skipped {bad_folder}/"
    found = {}
    for line in err.splitlines():
        if line.startswith(prefix):
            where, reason = line[len(prefix) :].split(": ", 1)
            found[where] = reason
    return found


@pytest.mark.parametrize("quiet", [[], ["--quiet"]], ids=["summary", "quiet"])
def test_bad_files_are_listed_one_per_line_on_stderr_even_when_quiet(
    bad_folder, tmp_path, capsys, quiet
):
    assert main([str(bad_folder), str(tmp_path / "out.lmdb"), "--store", "raw", *quiet]) == 0
    out, err = capsys.readouterr()
    listed = skipped_lines(err, bad_folder)
    assert len(listed) == 3 and len(err.splitlines()) == 3, err
    assert {key: listed[key] for key in SKIPPED_LINES} == SKIPPED_LINES
    if quiet:
        assert out == ""
    else:
        assert "skipped 3 unreadable images, listed on stderr" in out.splitlines()


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
        "backend:  lmdb (format version 3)",
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


# --- killing the packer: no process and no file left behind ----------------------------------

# A packer whose workers take 0.4 s per image (13 images, 2 workers: ~3 s of work), so a signal
# lands mid-run. Workers fork from this script, so they inherit the slowed encoder.
SLOW_PACKER = """
import sys, time
import fastloader.packing.worker as worker
encode_file = worker.encode_file

def slow(*args):
    time.sleep(0.4)
    return encode_file(*args)

worker.encode_file = slow
from fastloader.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _state(pid: int) -> tuple[str, int] | None:
    """``(state letter, parent pid)`` of a process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[1])


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = _state(int(entry))
            if state is not None and state[1] == pid:
                found.append(int(entry))
    return found


def _running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (_state(pid) or ("Z",))[0] != "Z"]


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _start_slow_packer(folder: Path, target: Path) -> tuple[subprocess.Popen, list[int]]:
    """Start the slow packer with 2 workers in its own session; return it once both work."""
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_PACKER, str(folder), str(target), "--store", "raw"]
        + ["--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        workers = _wait_for(
            lambda: len(_children(process.pid)) >= 2 and _children(process.pid), 60, "workers"
        )
        _wait_for(lambda: _partials(target.parent), 60, "the partial file")
    except BaseException:
        process.kill()
        process.communicate()
        raise
    return process, workers


def _partials(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".partial-" in name)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("signal_number", "group", "status", "message"),
    [
        (signal.SIGTERM, False, 143, "terminated (SIGTERM)"),
        (signal.SIGTERM, True, 143, "terminated (SIGTERM)"),  # a scheduler's time limit
        (signal.SIGINT, True, 130, "interrupted"),  # Ctrl-C in a terminal
    ],
    ids=["sigterm-main-process", "sigterm-process-group", "sigint-process-group"],
)
def test_a_stopped_packer_cleans_up_and_exits_with_the_signal_status(
    folder, tmp_path, signal_number, group, status, message
):
    target = tmp_path / "out.lmdb"
    process, workers = _start_slow_packer(folder, target)
    if group:
        os.killpg(process.pid, signal_number)
    else:
        process.send_signal(signal_number)
    _, err = process.communicate(timeout=60)
    assert process.returncode == status, err
    assert err == f"fastloader-pack: {message}\n"
    assert os.listdir(tmp_path) == []
    _wait_for(lambda: not _running(workers), 10, f"workers {workers} to exit")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_takes_the_workers_along_and_a_rerun_removes_the_partial_file(folder, tmp_path):
    target = tmp_path / "out.lmdb"
    process, workers = _start_slow_packer(folder, target)
    process.kill()
    process.communicate(timeout=60)
    _wait_for(lambda: not _running(workers), 10, f"workers {workers} to exit")
    (stale,) = _partials(tmp_path)
    assert stale.startswith(f".out.lmdb.partial-{process.pid}@")
    run = subprocess.run(
        [sys.executable, "-m", "fastloader.cli", str(folder), str(target), "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == (
        f"fastloader-pack: removed {tmp_path / stale}, left by packer process {process.pid} "
        "that no longer runs\n"
    )
    assert os.listdir(tmp_path) == ["out.lmdb"]
    assert len(open_pack(target)) == 13


def test_partial_files_of_live_or_other_host_packers_are_kept(folder, tmp_path):
    target = tmp_path / "out.h5"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f".out.h5.partial-{dead.pid}@{socket.gethostname()}",
            "dead-old-style": f".out.h5.partial-{dead.pid}",
            "live": f".out.h5.partial-{live.pid}@{socket.gethostname()}",
            "other-host": f".out.h5.partial-{dead.pid}@not-{socket.gethostname()}",
            "other-target": f".out.lmdb.partial-{dead.pid}",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"half a pack")
        summary = pack_function(folder, target, workers=0)
    finally:
        live.kill()
        live.wait()
    kept = {names[key] for key in ("live", "other-host", "other-target")}
    assert set(os.listdir(tmp_path)) == kept | {"out.h5"}
    removed = {tmp_path / names["dead"], tmp_path / names["dead-old-style"]}
    assert set(summary.removed_partials) == {(path, dead.pid) for path in removed}
    assert f"left by packer process {dead.pid} that no longer runs" in str(summary)


# --- start-up, messages, the `fastloader` command ---------------------------------------------


def test_importing_the_cli_and_asking_for_help_imports_no_heavy_module():
    # What makes `--help` and usage errors answer at once (benchmarks/cli_startup.py times it).
    script = (
        "import sys\n"
        "from fastloader.cli import fastloader_main, main\n"
        "codes = [main(['--help']), main(['only-src']), fastloader_main(['--help'])]\n"
        "heavy = ('torch', 'numpy', 'PIL', 'h5py', 'lmdb', 'tqdm')\n"
        "print(codes, sorted(name for name in heavy if name in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[0, 2, 0] []"


def test_cli_choices_are_the_library_ones():
    from fastloader.cli import FORMAT_CHOICES, STORE_CHOICES
    from fastloader.formats import FORMATS, STORE_MODES

    assert (FORMAT_CHOICES, STORE_CHOICES) == (tuple(FORMATS), tuple(STORE_MODES))


def test_a_dst_that_is_a_folder_says_to_name_the_pack_file(folder, tmp_path, capsys):
    (tmp_path / "packs").mkdir()
    assert main([str(folder), str(tmp_path / "packs")]) == 1
    err = one_error_line(capsys)
    assert f"{tmp_path / 'packs'}: is a folder; DST is the pack file to write" in err
    assert f"e.g. {tmp_path / 'packs' / 'src.lmdb'}" in err
    assert main([str(folder), str(tmp_path / "train")]) == 1
    assert f"{tmp_path / 'train'}: no suffix to tell the format from" in one_error_line(capsys)
    assert os.listdir(tmp_path) == ["packs"]


def test_verify_takes_only_the_pack(capsys):
    assert main(["--verify", "x.lmdb", "src"]) == 2
    assert "--verify takes only the pack" in capsys.readouterr().err
    assert main(["--verify", "x.lmdb", "--info", "x.lmdb"]) == 2


def test_check_reaches_pack_only_when_given(folder, tmp_path, monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(skipped=[], removed_partials=[])

    monkeypatch.setattr(importlib.import_module("fastloader.packing"), "pack", spy)
    assert main([str(folder), str(tmp_path / "a.lmdb"), "--check", "quick", "-q"]) == 0
    assert main([str(folder), str(tmp_path / "a.lmdb"), "-q"]) == 0
    assert calls[0]["check"] == "quick" and "check" not in calls[1]
    assert main([str(folder), str(tmp_path / "a.lmdb"), "--check", "slow"]) == 2


def test_fastloader_command_packs_describes_and_explains(folder, tmp_path, capsys):
    from fastloader.cli import fastloader_main

    target = tmp_path / "out.h5"
    assert fastloader_main(["pack", str(folder), str(target), "--store", "raw"]) == 0
    assert capsys.readouterr().out.startswith("packed 13 images of 3 classes")
    assert fastloader_main(["info", str(target)]) == 0
    assert "backend:  hdf5" in capsys.readouterr().out
    assert fastloader_main(["info", str(tmp_path / "nope.lmdb")]) == 1
    assert capsys.readouterr().err.startswith("fastloader info: error: ")
    assert fastloader_main(["pack", str(folder)]) == 2
    assert "usage: fastloader pack" in capsys.readouterr().err
    assert fastloader_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("pack", "info", "verify"))
    assert "python -m benchmarks" in out  # the demo is the suite's own command, not the CLI's
    assert fastloader_main([]) == 2
    assert fastloader_main(["frobnicate"]) == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def _imported_top_level(importtime_stderr: str) -> set[str]:
    """The top-level packages a process imported, from its ``python -X importtime`` stderr."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_packing_info_and_verify_import_no_torch(folder, tmp_path, suffix):
    # NOTE [ Torch-free pack files ]: these commands answer without torch's seconds of import.
    # The real console entry, run as a program; -X importtime lists every module it imports
    # (forked packing workers import nothing new: they inherit the parent's modules).
    target = tmp_path / f"p{suffix}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    runs = {
        "pack": [str(folder), str(target), "--store", "raw", "--workers", "2", "-q"],
        "info": ["--info", str(target)],
        "verify": ["--verify", str(target)],
    }
    for what, argv in runs.items():
        run = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "fastloader.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert run.returncode == 0, (what, run.stderr[-2000:])
        imported = _imported_top_level(run.stderr)
        assert "fastloader" in imported and "numpy" in imported  # the listing is real
        assert "torch" not in imported, what
    assert f"{target}: OK: 13 records" in run.stdout  # the last run: verify
