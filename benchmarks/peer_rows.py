"""Peer rows beside fastloader's, for ``any_sample`` (issue 38) and ``remote`` (issue 37).

Each peer (benchmarks/peer_litdata.py, benchmarks/peer_mds.py) builds its own copy of the
same samples from one HDF5 file and is read in interleaved rounds with fastloader's rows,
every loader made once (persistent workers). Before the timed rounds each loader's epoch
checksum is compared with the file's (benchmarks/peer_samples.py): ``samples_match`` says
whether a row read exactly the file's samples, each once. A peer that does not import gives a
row that says how to install it; one that fails gives a row with its error.

- ``any_sample``: the pose samples of benchmarks/column_packs.py (64x64x3 uint8 image, 17x2
  float32 keypoints, a name) and of benchmarks/any_sample.py (40x40x3 image and three more
  fields), each from the file itself and from its LMDB and HDF5 column packs, against litdata
  and MDS over local folders; batches of 64 and 256, 0 and 2 workers.
  ``vs_<peer>`` on our rows: ours over the peer, median of per-round ratios (goal vs MDS: >= 5x).
- ``remote``: 64x64x3 images and a label on a SeaweedFS server on loopback; per round and
  source a fresh cache, the first epoch (cold) and second (warm) of one loader; litdata and MDS
  get the cache limit fastloader's ``ShardedDataset`` takes by default, and shards of the same
  size. Goals: ours >= 1.5x litdata cold, >= 1.2x warm.
"""

from __future__ import annotations

import shutil
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import column_packs, peer_litdata, peer_mds
from benchmarks._stats import paired_ratio
from benchmarks.peer_samples import LoaderPeer, file_digest

PEERS: dict[str, tuple[str, Callable[[dict], Any], str]] = {  # key: (row name, class, install)
    "litdata": (peer_litdata.NAME, peer_litdata.LitdataPeer, peer_litdata.INSTALL),
    "mds": (peer_mds.NAME, peer_mds.MDSPeer, peer_mds.INSTALL),
}


class OurLoader(LoaderPeer):
    """fastloader's loader with the peers' ``epoch()``/``digest()``/``close()``."""

    def __init__(self, dataset: Any, batch: int, workers: int, fields: tuple[str, ...]) -> None:
        import fastloader

        self.fields = fields
        self.loader = fastloader.DataLoader(
            dataset, batch_size=batch, num_workers=workers, shuffle=True
        )


class Unavailable(Exception):
    """A peer with no copy of the samples: the message is the row's note."""


def _failed(error: BaseException) -> str:
    if isinstance(error, Unavailable):
        return str(error)
    if isinstance(error, ImportError):
        return str(error) if str(error).startswith("not installed") else f"not installed: {error}"
    traceback.print_exception(error)  # the whole story on stderr, its gist in the row
    return f"failed: {type(error).__name__}: {str(error)[:300]}"


def build_peers(source: Path, workdir: Path, count: int, shard: str) -> dict[str, Any]:
    """Each peer's copy of the file's rows: key -> folder, or the reason there is none."""
    built: dict[str, Any] = {}
    stem = source.stem
    for key, build in (
        ("litdata", lambda out: peer_litdata.build(source, out, count, shard)),
        ("mds", lambda out: peer_mds.build_in_venv(source, out, _bytes(shard))),
    ):
        out = workdir / f"{stem}-{key}"
        try:
            if key == "litdata" and not peer_litdata.available():
                raise ImportError(peer_litdata.INSTALL)
            if not (out / "index.json").exists():
                shutil.rmtree(out, ignore_errors=True)
                build(out)
            built[key] = out
        except Exception as error:  # noqa: BLE001 - the row says why
            built[key] = _failed(error)
    return built


def _bytes(size: str) -> int:
    return int(size.removesuffix("MB")) * 1024 * 1024


def _interleave(loaders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for number in range(rounds):
        names = list(loaders) if number % 2 == 0 else list(reversed(loaders))
        for name in names:
            samples, seconds = loaders[name].epoch()
            rates[name].append(samples / seconds)
    return rates


def _open_all(factories: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    loaders, reasons = {}, {}
    for name, factory in factories.items():
        try:
            loaders[name] = factory()
        except Exception as error:  # noqa: BLE001 - the row says why
            reasons[name] = _failed(error)
    return loaders, reasons


def _config_rows(
    factories: dict[str, Callable[[], Any]], rounds: int, expected: tuple
) -> tuple[list[dict], dict[str, list[float]]]:
    loaders, reasons = _open_all(factories)
    try:
        matches = {}
        for name, loader in loaders.items():  # the checksum epoch is also the warm-up
            matches[name] = loader.digest() == expected
        rates = _interleave(loaders, rounds)
    finally:
        for loader in loaders.values():
            loader.close()
    rows = []
    for name in factories:
        if name in reasons:
            rows.append({"reader": name, "samples_per_s": None, "note": reasons[name]})
            continue
        row = {
            "reader": name,
            "samples_per_s": round(statistics.median(rates[name]), 1),
            "samples_match": matches[name],
        }
        rows.append(row)
    return rows, rates


def guarded(table: Callable[..., dict], *args: Any) -> dict:
    """``table(*args)``, or a one-row table that says why it failed: a peer that crashes or
    hangs (MDSPeer's timeout) costs its table, never the comparison's own rows."""
    try:
        return table(*args)
    except Exception as error:  # noqa: BLE001 - the row says why
        return {"rows": [{"reader": "peers", "note": _failed(error)}], "ratios": {}, "notes": []}


def any_sample(size: str, workdir: Path) -> dict:
    """The ``any_sample`` peer table: rows, ratios, notes (see the module docstring)."""
    from benchmarks.any_sample import make_pose_file  # here: any_sample imports this module

    count, rounds, _, _ = column_packs.SIZES[size]
    sets = (  # (label, file): the pose samples, then any_sample's own (issue 18)
        ("pose 64x64x3", column_packs.make_pose64(workdir / f"pose64-{count}.h5", count)),
        ("pose 40x40x3, 4 fields", make_pose_file(workdir / f"pose-{count}.h5", count)),
    )
    rows, ratios = [], {}
    for label, source in sets:
        for row in _pose_table(source, size, workdir, ratios):
            rows.append({"samples": label, **row})
    notes = [
        f"peers: {count} samples of each pose file (64x64x3 uint8, 17x2 float32, a name; "
        "40x40x3 uint8, 14x2 float32, 14x3 float64, a name), each from one HDF5 file: read in "
        "place, from its LMDB and HDF5 column packs, from litdata optimize() (64 MB chunks) and "
        f"MDS (64 MB shards) of its rows, all local folders; {rounds} interleaved rounds after a "
        "checksum epoch; samples_match: the epoch's order-free checksum equals the file's; "
        "vs_<peer>: ours over the peer, median per-round ratio"
    ]
    return {"rows": rows, "ratios": ratios, "notes": notes}


def _pose_table(source: Path, size: str, workdir: Path, ratios: dict) -> list[dict]:
    """One pose file's rows: in place, its column packs and the peers, every configuration."""
    import fastloader

    _, rounds, batches, workers = column_packs.SIZES[size]
    packs = column_packs._packs(source, workdir, source.stem, ("columns",))
    built = build_peers(source, workdir, len(fastloader.HDF5Dataset(source)), "64MB")
    expected = file_digest(source)
    fields = tuple(sorted(_fields(source)))
    rows = []
    for batch in batches:
        for worker_count in workers:
            common = {"batch": batch, "workers": worker_count, "fields": fields}
            factories: dict[str, Callable[[], Any]] = {
                column_packs.IN_PLACE: lambda c=common: OurLoader(
                    fastloader.HDF5Dataset(source), c["batch"], c["workers"], fields
                )
            }
            for name, path in packs.items():
                factories[name] = lambda c=common, p=path: OurLoader(
                    fastloader.open_pack(p), c["batch"], c["workers"], fields
                )
            for key, (name, peer, _) in PEERS.items():
                where = built[key]
                factories[name] = (
                    (lambda c=common, p=peer, w=where: p({**c, "local": str(w)}))
                    if isinstance(where, Path)
                    else unavailable(where)
                )
            config_rows, rates = _config_rows(factories, rounds, expected)
            for row in config_rows:
                row.update(batch=batch, workers=worker_count)
            suffix = f"{source.stem.split('-')[0]}_b{batch}_w{worker_count}"
            _ratios(config_rows, rates, list(packs), suffix, ratios)
            rows += config_rows
    return rows


def _fields(source: Path) -> list[str]:
    import h5py

    with h5py.File(source, "r") as file:
        return list(file)


def unavailable(reason: str) -> Callable[..., Any]:
    """A loader factory that raises ``reason`` (a peer with no copy of the samples)."""

    def factory(*_: Any) -> Any:
        raise Unavailable(reason)

    return factory


def _ratios(rows: list[dict], rates: dict, ours: list[str], suffix: str, ratios: dict) -> None:
    """Adds ``vs_<peer>`` (ours over the peer) to each of our rows, and to ``ratios``."""
    for key, (peer, _, _) in PEERS.items():
        if peer not in rates:
            continue
        for row in rows:
            if row["reader"] in ours and row["reader"] in rates:
                ratio = round(paired_ratio(rates[row["reader"]], rates[peer]), 2)
                row[f"vs_{key}"] = ratio
                backend = row["reader"].split()[0].lower()
                ratios[f"peers_{backend}_pack_over_{key}_{suffix}"] = (
                    ratio  # suffix: file, batch, workers
                )
