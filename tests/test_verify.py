"""fastloader.verify and `fastloader-pack --verify` (formats.verify.run_cli): every bad record
listed, the exit status says whether the pack can be trusted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest

import fastloader
from fastloader import PackError
from fastloader.formats import RecordKind, encode_record, open_writer
from fastloader.formats.records import bind_record
from fastloader.formats.verify import run_cli

SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


def _pack(path, fmt, count=20):
    with open_writer(path, fmt, store="raw", classes=["a", "b"]) as writer:
        for index in range(count):
            pixels = np.full((5, 7, 3), index, dtype=np.uint8)
            writer.append(encode_record(pixels, index % 2, RecordKind.RAW), index % 2, f"a/{index}")
    return path


def _flip_payload_byte(path, fmt, index: int) -> None:
    """Flip one pixel byte of record ``index`` in place, keeping the file's structure."""
    record = encode_record(np.full((5, 7, 3), index, dtype=np.uint8), index % 2, RecordKind.RAW)
    marker = bind_record(record, index)  # as the writer stores it
    data = bytearray(path.read_bytes())
    at = data.find(marker)
    assert at >= 0
    data[at + len(marker) - 1] ^= 0x55
    path.write_bytes(data)


@pytest.fixture(params=sorted(SUFFIX))
def fmt(request):
    return request.param


def test_clean_pack_verifies(tmp_path, fmt, capsys):
    path = _pack(tmp_path / f"p{SUFFIX[fmt]}", fmt)
    report = fastloader.verify(path, progress=False)
    assert report.ok and report.records == 20 and report.bad == []
    assert run_cli(str(path)) == 0
    out, err = capsys.readouterr()
    assert f"p{SUFFIX[fmt]}: OK: 20 records" in out and err == ""
    assert run_cli(str(path), quiet=True) == 0
    assert capsys.readouterr() == ("", "")


def test_every_bad_record_is_listed_with_its_reason(tmp_path, fmt, capsys):
    path = _pack(tmp_path / f"p{SUFFIX[fmt]}", fmt)
    for index in (3, 17):
        _flip_payload_byte(path, fmt, index)
    report = fastloader.verify(path, progress=False)
    assert [index for index, _ in report.bad] == [3, 17]
    assert all("checksum mismatch" in reason for _, reason in report.bad)
    assert run_cli(str(path), quiet=True) == 1
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2
    assert lines[0].startswith(f"{path}: record 3: damaged record (checksum mismatch")
    assert run_cli(str(path)) == 1
    assert "2 bad records: 20 records" in capsys.readouterr().out
    # and training reads of the same records fail the same way
    with pytest.raises(PackError, match="record 17: damaged record"):
        fastloader.open_pack(path)[17]


def test_lmdb_record_outside_the_structure_is_listed(tmp_path):
    path = _pack(tmp_path / "p.lmdb", "lmdb")
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put((5).to_bytes(8, "big"), b"FL" + b"\0" * 10)
    env.close()
    report = fastloader.verify(path, progress=False)
    assert [index for index, _ in report.bad] == [5]
    assert "truncated record" in report.bad[0][1]


def test_a_file_that_cannot_be_opened_exits_2(tmp_path, fmt, capsys):
    path = _pack(tmp_path / f"p{SUFFIX[fmt]}", fmt)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    assert run_cli(str(path)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("fastloader-pack: error: ") and str(path) in err
    assert run_cli(str(tmp_path / "absent.lmdb")) == 2
    assert "absent.lmdb" in capsys.readouterr().err
    with pytest.raises(PackError, match=str(path)):
        fastloader.verify(path)


# --- the console commands, run as programs ---------------------------------------------------

# command name -> (python -m MODULE, its verify argument)
VERIFY_COMMANDS = {
    "fastloader-pack": ("fastloader.cli", "--verify"),
    "fastloader verify": ("fastloader", "verify"),
}


def _run_command(command: str, path: Path) -> subprocess.CompletedProcess:
    module, verb = VERIFY_COMMANDS[command]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    return subprocess.run(
        [sys.executable, "-m", module, verb, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("command", sorted(VERIFY_COMMANDS))
def test_verify_commands_exit_0_clean_1_bad_records_2_not_a_pack(tmp_path, fmt, command):
    path = _pack(tmp_path / f"p{SUFFIX[fmt]}", fmt)
    clean = _run_command(command, path)
    assert (clean.returncode, clean.stderr) == (0, ""), clean.stderr
    assert clean.stdout.startswith(f"{path}: OK: 20 records and the metadata checked in ")

    _flip_payload_byte(path, fmt, 7)
    bad = _run_command(command, path)
    assert bad.returncode == 1, bad.stderr
    lines = bad.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"{path}: record 7: damaged record (checksum mismatch: stored "
    )
    assert bad.stdout.startswith(f"{path}: 1 bad records: 20 records")

    other = tmp_path / f"notes{SUFFIX[fmt]}"
    other.write_text("not a pack, just some notes\n" * 50)
    foreign = _run_command(command, other)
    assert (foreign.returncode, foreign.stdout) == (2, "")
    named = {"lmdb": "an LMDB file", "hdf5": "an HDF5 file"}[fmt]
    assert foreign.stderr == (
        f"{command}: error: {other}: not a fastloader pack (named as {named} but it does not "
        f"start like one: the start of the file is damaged, or it is another kind of file)\n"
    )
