"""Hostile images when packing: a pixel bomb or a scan bomb is one skip line with its reason
(never a dead pool, an OOM kill or a stuck run), a worker killed by an image is replaced, and
every JPEG Pillow loads despite a harmless libjpeg complaint is packed."""

import io
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from _images import ImageDataset, encode
from PIL import Image

from fastloader import open_pack, pack
from fastloader.vision.image_limits import check_pixels

# --- crafted files ------------------------------------------------------------------------


def _jpeg(width: int = 64, height: int = 48, seed: int = 0, **options) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", **options)


def _jpeg_bomb() -> bytes:
    """A small progressive JPEG whose frame header declares 65500 x 65500 pixels."""
    data = bytearray(_jpeg(16, 16, progressive=True))
    sof = data.index(b"\xff\xc2")
    data[sof + 5 : sof + 9] = (65500).to_bytes(2, "big") * 2  # height, width
    return bytes(data)


def _png_bomb() -> bytes:
    """A small PNG whose IHDR declares 60000 x 60000 pixels (CRC fixed)."""
    data = bytearray(encode(Image.new("RGB", (8, 8)), "PNG"))
    data[16:24] = (60000).to_bytes(4, "big") * 2
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


def _segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each segment; a scan's end includes its entropy-coded data."""
    position, found = 2, []
    while position < len(data):
        marker = data[position + 1]
        if marker == 0xD9:
            found.append((marker, position, position + 2))
            break
        end = position + 2 + int.from_bytes(data[position + 2 : position + 4], "big")
        if marker == 0xDA:
            while True:
                end = data.index(b"\xff", end)
                if data[end + 1] == 0 or 0xD0 <= data[end + 1] <= 0xD7:
                    end += 2
                    continue
                break
        found.append((marker, position, end))
        position = end
    return found


def _scan_bomb(scans: int) -> bytes:
    """A 4096 x 4096 progressive JPEG whose last scan is repeated ``scans`` times: each repeat
    is a few bytes and costs libjpeg a pass over all 262 144 blocks (minutes at 20 000)."""
    data = encode(Image.new("RGB", (4096, 4096), (120, 130, 140)), "JPEG", progressive=True)
    ends = [end for marker, _, end in _segments(data) if marker == 0xDA]
    last = data[ends[-2] : ends[-1]]  # its Huffman table and the scan
    return data[: ends[-1]] + last * scans + data[ends[-1] :]


# The standard luminance Huffman tables (JPEG spec, annex K.3), used for every component.
_DC_BITS = [0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
_AC_BITS = [0, 2, 1, 3, 3, 2, 4, 3, 5, 5, 4, 4, 0, 0, 1, 0x7D]
_AC_VALUES = bytes.fromhex(
    "01020300041105122131410613516107227114328191a1082342b1c11552d1f0243362728209"
    "0a161718191a25262728292a3435363738393a434445464748494a535455565758595a636465"
    "666768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5a6a7a8a9"
    "aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6e7e8e9ea"
    "f1f2f3f4f5f6f7f8f9fa"
)


def _huffman(bits: list[int], values: bytes) -> dict[int, tuple[int, int]]:
    code, position, table = 0, 0, {}
    for length, count in enumerate(bits, start=1):
        for _ in range(count):
            table[values[position]] = (code, length)
            position += 1
            code += 1
        code <<= 1
    return table


def _flat_jpeg(width: int, height: int, factors: list[tuple[int, int]]) -> bytes:
    """A valid baseline JPEG of one flat colour whose components have the given (h, v)
    sampling factors: any of them, not only the subsamplings encoders offer."""
    dc, ac = _huffman(_DC_BITS, bytes(range(12))), _huffman(_AC_BITS, _AC_VALUES)
    levels = [100, -50, 80][: len(factors)]  # DC values (quantiser 1)
    out = bytearray(b"\xff\xd8\xff\xdb\x00\x43\x00" + bytes([1] * 64))
    frame = bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big")
    frame += bytes([len(factors)])
    frame += b"".join(bytes([i + 1, h << 4 | v, 0]) for i, (h, v) in enumerate(factors))
    out += b"\xff\xc0" + (len(frame) + 2).to_bytes(2, "big") + frame
    tables = bytes([0x00, *_DC_BITS, *range(12), 0x10, *_AC_BITS]) + _AC_VALUES
    out += b"\xff\xc4" + (len(tables) + 2).to_bytes(2, "big") + tables
    scan = bytes([len(factors)]) + b"".join(bytes([i + 1, 0]) for i in range(len(factors)))
    scan += bytes([0, 63, 0])
    out += b"\xff\xda" + (len(scan) + 2).to_bytes(2, "big") + scan
    h_max, v_max = max(h for h, _ in factors), max(v for _, v in factors)
    mcus = -(-width // (8 * h_max)) * -(-height // (8 * v_max))
    bits: list[int] = []
    for mcu in range(mcus):
        for component, (h, v) in enumerate(factors):
            for block in range(h * v):
                first = mcu == 0 and block == 0
                size = abs(levels[component]).bit_length() if first else 0
                code, length = dc[size]
                bits += [(code >> b) & 1 for b in range(length - 1, -1, -1)]
                if size:
                    value = (
                        levels[component]
                        if levels[component] > 0
                        else levels[component] + (1 << size) - 1
                    )
                    bits += [(value >> b) & 1 for b in range(size - 1, -1, -1)]
                code, length = ac[0x00]  # end of block: no AC coefficient
                bits += [(code >> b) & 1 for b in range(length - 1, -1, -1)]
    bits += [1] * (-len(bits) % 8)
    for start in range(0, len(bits), 8):
        byte = int("".join(map(str, bits[start : start + 8])), 2)
        out += bytes([byte, 0]) if byte == 0xFF else bytes([byte])
    return bytes(out + b"\xff\xd9")


def _insert_before(data: bytes, marker: bytes, junk: bytes) -> bytes:
    at = data.index(marker)
    return data[:at] + junk + data[at:]


def _bad_icc(data: bytes) -> bytes:
    payload = b"ICC_PROFILE\x00" + bytes([0, 0]) + b"not a profile" * 3  # sequence 0 of 0
    return data[:2] + b"\xff\xe2" + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]


def _damaged_scan(data: bytes) -> bytes:
    """Entropy-coded data overwritten so that Pillow's decoder fails too."""
    scan = data.index(b"\xff\xda")
    start = scan + 2 + int.from_bytes(data[scan + 2 : scan + 4], "big")
    damaged = bytearray(data)
    for at in range(start + 20, len(data) - 2, 7):
        damaged[at] = (damaged[at] * 31 + 7) & 0xFE
    return bytes(damaged)


def _pillow_loads(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception:
        return False
    return True


# --- the pixel limit ------------------------------------------------------------------------


@pytest.mark.parametrize("bomb", [_jpeg_bomb, _png_bomb])
def test_pixel_limit_is_pillows_and_follows_it(bomb, monkeypatch):
    data = bomb()
    with pytest.raises(Image.DecompressionBombError) as pillows:
        Image.open(io.BytesIO(data))
    with pytest.raises(Image.DecompressionBombError) as ours:
        check_pixels(data)
    assert str(ours.value) == str(pillows.value)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # the user lifted it
    check_pixels(data)
    small = _jpeg(64, 48)
    check_pixels(small)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 48 // 2 - 1)  # refused past twice it
    with pytest.raises(Image.DecompressionBombError):
        check_pixels(small)


_BOUNDED_CLI = """
import os, resource, sys
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
if os.environ.get("NO_SCAN_CAP"):  # reach the time limit (forked workers inherit it)
    import fastloader.vision.images
    fastloader.vision.images.MAX_JPEG_SCANS = None
from fastloader.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run_cli(args: list[str], memory: int = 3 << 30, timeout: float = 120, scan_cap: bool = True):
    started = time.monotonic()
    env = dict(os.environ) if scan_cap else {**os.environ, "NO_SCAN_CAP": "1"}
    process = subprocess.run(
        [sys.executable, "-c", _BOUNDED_CLI, str(memory), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return process, time.monotonic() - started


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("store", ["encoded", "raw"])
def test_bombs_are_skip_lines_in_a_memory_bound(tmp_path, workers, store):
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    (source / "a" / "good.jpg").write_bytes(_jpeg())
    (source / "a" / "jpeg-bomb.jpg").write_bytes(_jpeg_bomb())
    (source / "a" / "png-bomb.png").write_bytes(_png_bomb())
    target = tmp_path / "out.h5"  # LMDB reserves 1 TiB of address space: no RLIMIT_AS for it
    process, _ = _run_cli([str(source), str(target), "--workers", workers, "--store", store])
    assert process.returncode == 0, process.stderr
    skipped = [line for line in process.stderr.splitlines() if "skipped" in line]
    assert len(skipped) == 2 and all("DecompressionBombError" in line for line in skipped)
    assert "Traceback" not in process.stderr and "BrokenProcessPool" not in process.stderr
    assert len(open_pack(target)) == 1


# --- the time limit -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scan_bomb_folder(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("scans") / "src"
    (source / "a").mkdir(parents=True)
    for index in range(3):
        (source / "a" / f"good{index}.jpg").write_bytes(_jpeg(seed=index))
    (source / "a" / "scan-bomb.jpg").write_bytes(_scan_bomb(2000))
    return source


@pytest.mark.parametrize(
    ("workers", "options"),
    [
        ("2", []),
        pytest.param("1", [], marks=pytest.mark.slow),
        pytest.param("2", ["--store", "raw", "--check", "quick"], marks=pytest.mark.slow),
    ],
)
def test_a_scan_bomb_is_stopped_at_the_time_limit_and_skipped(
    scan_bomb_folder, tmp_path, workers, options
):
    target = tmp_path / "out.h5"
    args = [str(scan_bomb_folder), str(target), "--workers", workers, "--image-timeout", "2"]
    process, seconds = _run_cli(args + options, scan_cap=False)  # the time limit's own test
    assert process.returncode == 0, process.stderr
    (line,) = [line for line in process.stderr.splitlines() if "skipped" in line]
    assert "scan-bomb.jpg: took more than 2 s to decode" in line
    assert len(open_pack(target)) == 3
    assert seconds < 60  # stopped, not decoded for minutes (a bound far above the limit)


def test_a_scan_bomb_is_refused_by_its_scan_count_before_decoding(scan_bomb_folder, tmp_path):
    target = tmp_path / "out.h5"
    process, _ = _run_cli([str(scan_bomb_folder), str(target), "--workers", "1"])
    assert process.returncode == 0, process.stderr
    (line,) = [line for line in process.stderr.splitlines() if "skipped" in line]
    assert "scan-bomb.jpg: progressive JPEG with more than 500 scans" in line
    assert len(open_pack(target)) == 3


def test_an_image_that_kills_its_worker_is_retried_then_skipped(tmp_path):
    """A worker killed while encoding one sample (as the OOM killer would): replaced, the
    sample tried once more, then skipped naming the signal; every other sample is packed."""
    summary = pack(_KillsAt(5, n=12), tmp_path / "out.lmdb", store="raw", workers=2)
    assert summary.count == 11
    ((where, reason),) = summary.skipped
    assert where == "5" and "died decoding it, 2 times: killed by SIGKILL" in reason
    dataset = open_pack(tmp_path / "out.lmdb", decode="numpy")
    assert [int(dataset[i][0][0, 0, 0]) for i in range(11)] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]


class _KillsAt(ImageDataset):
    def __init__(self, at: int, n: int) -> None:
        super().__init__("hwc", n)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full((8, 8, 3), index, np.uint8), 0


# --- Pillow decides -----------------------------------------------------------------------


def test_flat_jpeg_fixture_is_what_libjpeg_and_pillow_decode():
    plain = _flat_jpeg(48, 32, [(1, 1), (1, 1), (1, 1)])
    odd = _flat_jpeg(48, 32, [(1, 2), (2, 1), (1, 1)])
    with Image.open(io.BytesIO(plain)) as image:
        expected = np.asarray(image.convert("RGB"))
    assert (expected == expected[0, 0]).all() and check_pixels(plain) is None
    with Image.open(io.BytesIO(odd)) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), expected)


def test_jpegs_pillow_loads_despite_a_libjpeg_warning_are_packed(tmp_path):
    good = _jpeg(seed=3)
    files = {
        "junk-before-a-marker.jpg": _insert_before(good, b"\xff\xdb", b"\x12\x34\x56"),
        "padding-before-the-end.jpg": good[:-2] + b"\x00" * 16 + good[-2:],
        "bad-icc-marker.jpg": _bad_icc(good),
        "subsampled-1x2-2x1-1x1.jpg": _flat_jpeg(48, 32, [(1, 2), (2, 1), (1, 1)]),
        "subsampled-3x1-1x1-1x1.jpg": _flat_jpeg(48, 32, [(3, 1), (1, 1), (1, 1)]),
        "damaged-scan-data.jpg": _damaged_scan(good),
    }
    loads = [_pillow_loads(data) for data in files.values()]
    assert loads == [True, True, True, True, True, False]
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    for name, data in files.items():
        (source / "a" / name).write_bytes(data)
    for store in ("encoded", "raw"):
        summary = pack(source, tmp_path / f"{store}.lmdb", store=store, workers=0)
        assert summary.count == 5
        assert [Path(where).name for where, _ in summary.skipped] == ["damaged-scan-data.jpg"]


def test_a_slow_writer_never_makes_a_quick_image_late():
    """Results wait in the pipe while the writer is busy: that time is not the image's."""
    from fastloader.packing.pool import encode_in_workers
    from fastloader.packing.worker import DatasetEncoder, Options

    encoder = DatasetEncoder(ImageDataset("hwc", 4), Options("raw", 90, None), 2)
    results = []
    for result in encode_in_workers(encoder, range(4), 2, "fork", seconds=0.3):
        results.append(result)
        time.sleep(0.5)  # a writer slower than the limit
    assert [result.reason for result in results] == [None] * 4


class _HoldsTheGilAt(ImageDataset):
    """Sample ``at`` never returns and holds the GIL meanwhile (a C call through PyDLL), so
    results of the samples before it cannot leave its worker."""

    def __init__(self, at: int, n: int) -> None:
        super().__init__("hwc", n)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            import ctypes

            ctypes.PyDLL(None).sleep(1000)
        return np.full((8, 8, 3), index, np.uint8), 0


def test_the_time_limit_blames_the_sample_at_work_not_one_whose_result_waits(tmp_path):
    dataset = _HoldsTheGilAt(5, n=24)
    summary = pack(dataset, tmp_path / "out.h5", store="raw", workers=1, image_timeout=1)
    assert summary.skipped == [("5", "took more than 1 s to decode (a scan bomb?); stopped")]
    assert summary.count == 23
