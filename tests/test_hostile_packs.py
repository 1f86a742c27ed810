"""Crafted and damaged packs: only PackError naming the file, never a crash, a read outside the
file, or an allocation the file's size does not justify (issue 10's cases, one test each)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest

from fastloader import HDF5Dataset, LMDBDataset, PackError, open_pack
from fastloader.formats import RecordKind, encode_record, open_writer
from fastloader.formats.metadata import _canonical, array_checksum

CLASSES = ["a", "b"]
GIB = 1 << 30


def _write(path: Path, fmt: str, count: int = 6, side: int = 40) -> Path:
    """A valid raw pack; records of ``side`` x ``side`` x 3 (4.8 KB: LMDB overflow pages)."""
    with open_writer(path, fmt, store="raw", classes=CLASSES) as writer:
        for index in range(count):
            pixels = np.full((side, side, 3), index, dtype=np.uint8)
            writer.append(encode_record(pixels, index % 2, RecordKind.RAW), index % 2, f"x/{index}")
    return path


def _copy_h5(source: Path, target: Path, replace: dict) -> None:
    """Copy an HDF5 pack's datasets, letting ``replace[name](file, data)`` write some instead."""
    with h5py.File(source, "r") as old, h5py.File(target, "w") as new:
        for name in old:
            data = old[name][()]
            if name in replace:
                replace[name](new, data)
            else:
                new.create_dataset(name, data=data)


def _metadata(path: Path) -> dict:
    with h5py.File(path, "r") as file:
        return json.loads(file["metadata"][()].tobytes())


def _put_metadata(file: h5py.File, raw: bytes) -> None:
    file.create_dataset("metadata", data=np.frombuffer(raw, dtype=np.uint8))


def _sealed(metadata: dict) -> bytes:
    metadata = dict(metadata)
    metadata["checksum"] = array_checksum(_canonical(metadata))
    return json.dumps(metadata).encode()


@pytest.fixture
def h5_pack(tmp_path) -> Path:
    return _write(tmp_path / "good.h5", "hdf5")


# --- HDF5: only the layout fastloader writes --------------------------------------------------


def test_sparse_gzip_dataset_declaring_gigabytes_is_refused_unread(h5_pack, tmp_path):
    crafted = tmp_path / "bomb.h5"

    def bomb(file, data):  # 1.5 GiB declared, chunked + gzip, nothing written: a tiny file
        file.create_dataset(
            "records", shape=(3 * GIB // 2,), dtype=np.uint8, chunks=(1 << 20,), compression="gzip"
        )

    _copy_h5(h5_pack, crafted, {"records": bomb})
    assert crafted.stat().st_size < 64 << 10
    with pytest.raises(
        PackError, match="bomb.h5: not a fastloader pack .records is not stored contiguously"
    ):
        open_pack(crafted)


def test_declared_long_targets_are_refused_before_reading(h5_pack, tmp_path):
    crafted = tmp_path / "long.h5"

    def long_targets(file, data):  # declares 1.6 GB of labels that the file does not hold
        file.create_dataset("targets", shape=(200_000_000,), dtype="<i8")

    _copy_h5(h5_pack, crafted, {"targets": long_targets})
    assert crafted.stat().st_size < 64 << 10
    with pytest.raises(
        PackError,
        match="long.h5: truncated or damaged HDF5 file .targets declares 1600000000 bytes",
    ):
        HDF5Dataset(crafted)


def test_external_storage_pointing_at_another_file_is_refused(h5_pack, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"the machine's secrets" * 1000)
    crafted = tmp_path / "external.h5"

    def external(file, data):
        file.create_dataset(
            "records", shape=(len(data),), dtype=np.uint8, external=[(str(secret), 0, len(data))]
        )

    _copy_h5(h5_pack, crafted, {"records": external})
    with pytest.raises(PackError, match="external.h5: .*external or virtual storage is refused"):
        open_pack(crafted, decode="bytes")


def test_virtual_dataset_and_links_are_refused(h5_pack, tmp_path):
    virtual = tmp_path / "virtual.h5"

    def make_virtual(file, data):
        layout = h5py.VirtualLayout(shape=(len(data),), dtype=np.uint8)
        layout[:] = h5py.VirtualSource(str(h5_pack), "records", shape=(len(data),))
        file.create_virtual_dataset("records", layout)

    _copy_h5(h5_pack, virtual, {"records": make_virtual})
    with pytest.raises(PackError, match="virtual.h5: .*records is not stored contiguously"):
        open_pack(virtual)
    linked = tmp_path / "linked.h5"
    _copy_h5(
        h5_pack,
        linked,
        {
            "records": lambda f, d: f.__setitem__(
                "records", h5py.ExternalLink(str(h5_pack), "records")
            )
        },
    )
    with pytest.raises(PackError, match="linked.h5: not a fastloader pack .records is a link"):
        open_pack(linked)


def test_unexpected_dtypes_and_float_labels_are_refused(h5_pack, tmp_path):
    floats = tmp_path / "floats.h5"
    _copy_h5(
        h5_pack,
        floats,
        {"targets": lambda f, d: f.create_dataset("targets", data=d.astype(np.float64))},
    )
    with pytest.raises(PackError, match="floats.h5: not a fastloader pack .targets is float64"):
        open_pack(floats)
    extra = tmp_path / "extra.h5"
    _copy_h5(h5_pack, extra, {})
    with h5py.File(extra, "a") as file:
        file["payload"] = np.zeros(4)
    with pytest.raises(PackError, match="unexpected datasets \\['payload'\\]"):
        open_pack(extra)
    undecodable = tmp_path / "undecodable.h5"  # a name h5py gives back as bytes (fuzzing found)
    data = h5_pack.read_bytes()
    assert data.count(b"source_offsets\0") == 1
    undecodable.write_bytes(data.replace(b"source_offsets\0", b"source_offset\x86\0"))
    with pytest.raises(PackError, match="undecodable.h5: not a fastloader pack .unexpected"):
        open_pack(undecodable)


# --- metadata: bounded JSON, every field checked ------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "corrupt metadata .JSON nested deeper than 16"),
        (b'{"count": ' + b"7" * 5000 + b"}", "corrupt metadata .Exceeds the limit"),
        (b"[1, 2, 3]", "not a fastloader pack .foreign metadata"),
        (b"\xff\xfe{}", "corrupt metadata"),
    ],
    ids=["deep", "5000 digits", "array", "not utf-8"],
)
def test_hostile_metadata_is_a_pack_error(h5_pack, tmp_path, raw, problem):
    crafted = tmp_path / "meta.h5"
    _copy_h5(h5_pack, crafted, {"metadata": lambda f, d: _put_metadata(f, raw)})
    with pytest.raises(PackError, match=f"meta.h5: {problem}"):
        open_pack(crafted)


def test_labels_must_be_within_the_classes_even_when_resealed(h5_pack, tmp_path):
    crafted = tmp_path / "noclass.h5"
    metadata = {**_metadata(h5_pack), "classes": []}
    _copy_h5(h5_pack, crafted, {"metadata": lambda f, d: _put_metadata(f, _sealed(metadata))})
    with pytest.raises(PackError, match="noclass.h5: corrupt metadata .no classes"):
        open_pack(crafted)
    crafted = tmp_path / "twoclass.h5"
    labels = np.array([0, 1, 5, 1, 0, 1], dtype="<i8")
    metadata = _metadata(h5_pack)
    metadata["checksums"]["labels"] = array_checksum(labels)
    _copy_h5(
        h5_pack,
        crafted,
        {
            "metadata": lambda f, d: _put_metadata(f, _sealed(metadata)),
            "targets": lambda f, d: f.create_dataset("targets", data=labels),
        },
    )
    with pytest.raises(PackError, match="twoclass.h5: corrupt pack .a label is outside the 2"):
        open_pack(crafted)


# --- LMDB: the structure LMDB trusts is checked first ----------------------------------------


def _leaf_nodes(data: bytes, psize: int = 4096):
    """Yield (node offset, size, flags, key) of every leaf node of an LMDB file."""
    page = 2
    while page < len(data) // psize:
        base = page * psize
        _, _, flags, lower, _ = struct.unpack_from("<QHHHH", data, base)
        page += struct.unpack_from("<I", data, base + 12)[0] if flags & 0x04 else 1  # overflow
        if flags & 0x02:  # P_LEAF
            for pointer in struct.unpack_from(f"<{(lower - 16) // 2}H", data, base + 16):
                lo, hi, node_flags, ksize = struct.unpack_from("<HHHH", data, base + pointer)
                key = data[base + pointer + 8 : base + pointer + 8 + ksize]
                yield base + pointer, lo | hi << 16, node_flags, key


def _read_in_subprocess(path: Path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        from fastloader import PackError, open_pack
        try:
            dataset = open_pack({str(path)!r}, decode="bytes")
            for index in range(len(dataset)):
                dataset[index]
        except PackError as error:
            print("PackError:", error)
        else:
            print("read")
    """)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env(),
    )


def _child_env() -> dict[str, str]:
    """The environment of a child that reads a pack: this checkout first on its path."""
    path = os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_lmdb_value_size_past_the_file_end_is_an_error_not_sigbus(tmp_path):
    # The SIGBUS of issue 10: LMDB trusts a big value's size from its leaf node; enlarged, the
    # value runs past the end of the file inside the memory map, and touching it kills the
    # process. Checked here for every record's node.
    path = _write(tmp_path / "p.lmdb", "lmdb")
    data = path.read_bytes()
    nodes = [node for node in _leaf_nodes(data) if node[2] & 0x01 and len(node[3]) == 8]
    assert len(nodes) == 6  # every record is a big value on overflow pages
    offset, size, _, key = nodes[-1]
    crafted = bytearray(data)
    struct.pack_into("<HH", crafted, offset, 0, (size >> 16) + 16)  # + 1 MiB
    path.write_bytes(crafted)
    run = _read_in_subprocess(path)
    assert run.returncode == 0, f"crashed ({run.returncode}): {run.stderr[-2000:]}"
    index = int.from_bytes(key, "big")
    assert f"p.lmdb: damaged LMDB file (record {index} lies outside the file)" in run.stdout


@pytest.mark.parametrize("order", [[2, 0, 1, 3, 4, 5], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
def test_lmdb_one_damaged_node_fails_only_its_record_in_any_read_order(tmp_path, order):
    # Records are located from leaves parsed once (NOTE [ Record spans ]): whether the damaged
    # record is read first (its leaf not yet parsed) or after its neighbours, it is a PackError
    # and every other record of the leaf still reads its own pixels.
    path = _write(tmp_path / "p.lmdb", "lmdb")
    data = bytearray(path.read_bytes())
    nodes = {int.from_bytes(k, "big"): o for o, _, f, k in _leaf_nodes(bytes(data)) if len(k) == 8}
    struct.pack_into("<HH", data, nodes[2], 0, 0x7FFF)  # record 2's size: ~2 GiB
    path.write_bytes(data)
    code = textwrap.dedent(f"""
        from fastloader import PackError, LMDBDataset
        dataset = LMDBDataset({str(path)!r}, decode="numpy")
        for index in {order!r}:
            try:
                pixels, label = dataset[index]
                print(index, "read", int(pixels.min()), int(pixels.max()), label)
            except PackError as error:
                print(index, "PackError", error)
    """)
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=_child_env(),
    )  # fmt: skip
    assert run.returncode == 0, f"crashed ({run.returncode}): {run.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines.pop("2") == (
        f"PackError {path}: damaged LMDB file (record 2 lies outside the file)"
    )
    assert lines == {str(i): f"read {i} {i} {i % 2}" for i in (0, 1, 3, 4, 5)}


@pytest.mark.parametrize("field", ["last page", "root page", "page size", "magic"])
def test_lmdb_meta_page_pointing_outside_the_file_is_refused(tmp_path, field):
    path = _write(tmp_path / "p.lmdb", "lmdb")
    data = bytearray(path.read_bytes())
    meta = 16  # after the page header; both meta pages are damaged alike
    for page in (0, 4096):
        where = {"last page": 120, "root page": 112, "page size": 24, "magic": 0}[field]
        struct.pack_into("<I", data, page + meta + where, 0x7FFFFFF0)
    path.write_bytes(data)
    run = _read_in_subprocess(path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "PackError: " in run.stdout and "p.lmdb: " in run.stdout


def test_lmdb_errors_are_pack_errors_naming_the_file(tmp_path):
    path = _write(tmp_path / "p.lmdb", "lmdb")
    data = bytearray(path.read_bytes())
    for offset, _, _, key in _leaf_nodes(bytes(data)):
        if key == b"__metadata__":
            struct.pack_into("<H", data, offset + 6, 0xFFF0)  # a key size beyond the page
    path.write_bytes(data)
    with pytest.raises(PackError, match="p.lmdb: "):
        LMDBDataset(path)


def test_lmdb_entry_count_must_match_the_metadata(tmp_path):
    path = _write(tmp_path / "p.lmdb", "lmdb")
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"stowaway", b"x")
    env.close()
    with pytest.raises(PackError, match="p.lmdb: corrupt pack .11 LMDB entries for 6 records"):
        LMDBDataset(path)


# --- messages in the user's words ---------------------------------------------------------------


def test_empty_file_and_damaged_start_are_named(tmp_path, h5_pack):
    empty = tmp_path / "empty.lmdb"
    empty.touch()
    for opener in (open_pack, LMDBDataset, HDF5Dataset):
        with pytest.raises(PackError, match="empty.lmdb: empty file .0 bytes., not a pack"):
            opener(empty)
    data = bytearray(h5_pack.read_bytes())
    data[1] ^= 0xFF  # the HDF5 signature
    h5_pack.write_bytes(data)
    with pytest.raises(
        PackError,
        match="good.h5: not a fastloader pack .named as an HDF5 file "
        "but it does not start like one",
    ):
        open_pack(h5_pack)


def test_lmdb_records_too_large_for_the_span_table_are_walked_on_every_read(tmp_path, monkeypatch):
    # NOTE [ Record spans ]: a record over the table's size limit (16 MiB) is not cached but
    # still read, checked, from a walk of the tree each time. The limit is lowered here.
    from fastloader.formats import lmdb_checks

    monkeypatch.setattr(lmdb_checks, "_MAX_SIZE", 100)  # the records here are ~4.8 KB
    path = _write(tmp_path / "p.lmdb", "lmdb")
    dataset = LMDBDataset(path, decode="numpy")
    for _ in range(2):
        for index in (3, 0, 5, 1, 4, 2):
            pixels, label = dataset[index]
            assert (pixels.min(), pixels.max(), label) == (index, index, index % 2)
    spans = dataset._handle_here().spans["records"]
    assert not spans._spans.any()  # nothing cached: every read above was a walk


def test_lmdb_record_pointed_at_another_records_pages_fails_its_checksum(tmp_path):
    # NOTE [ Checksums bound to positions ]: record 2's overflow-page number is redirected to
    # record 4's pages, a whole record with a right checksum and the same label. LMDB returns
    # record 4's bytes for key 2; the checksum, bound to position 2, refuses them.
    path = _write(tmp_path / "p.lmdb", "lmdb")
    data = bytearray(path.read_bytes())
    nodes = {int.from_bytes(k, "big"): o for o, _, f, k in _leaf_nodes(bytes(data)) if len(k) == 8}
    pgno = struct.unpack_from("<Q", data, nodes[4] + 16)[0]  # node header 8 + key 8
    struct.pack_into("<Q", data, nodes[2] + 16, pgno)
    path.write_bytes(data)
    dataset = LMDBDataset(path, decode="numpy")
    with pytest.raises(PackError, match=r"p.lmdb record 2: damaged record \(checksum mismatch"):
        dataset[2]
    pixels, label = dataset[4]
    assert (pixels.min(), pixels.max(), label) == (4, 4, 0)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_format_2_packs_are_still_read_and_info_says_their_checksums_are_unbound(
    tmp_path, monkeypatch, fmt
):
    from fastloader.formats import metadata, pack_writer

    with monkeypatch.context() as patched:  # what fastloader wrote before format 3
        patched.setattr(metadata, "FORMAT_VERSION", 2)
        patched.setattr(pack_writer, "bind_record", lambda record, position: record)
        path = _write(tmp_path / f"p.{'lmdb' if fmt == 'lmdb' else 'h5'}", fmt)
    dataset = open_pack(path, decode="numpy")
    assert dataset.metadata["version"] == 2
    for index in range(6):
        pixels, label = dataset[index]
        assert (pixels.min(), label) == (index, index % 2)
    info = subprocess.run(
        [sys.executable, "-m", "fastloader.cli", "--info", str(path)],
        capture_output=True, text=True, timeout=60, env=_child_env(),
    )  # fmt: skip
    assert "format version 2): record checksums not bound to positions" in info.stdout
