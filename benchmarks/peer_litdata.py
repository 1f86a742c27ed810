"""litdata as a peer row: ``optimize()`` of the same samples, read by its ``StreamingDataset``.

litdata runs in the benchmark's own process (``pip install --no-deps litdata==0.2.76
obstore==0.12.1``: a plain install replaces torch with a CUDA build). Its copy of the samples
is written by ``optimize()`` from the HDF5 file every peer starts from
(benchmarks/peer_samples.py); it is read by
``StreamingDataset`` + ``StreamingDataLoader`` (persistent workers, made once) from a local
folder or from S3 (``storage_options={"endpoint_url": ...}``; with ``obstore`` installed litdata
fetches chunks with it, else with boto3: NOTE [ litdata's obstore over http:// ]).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from benchmarks.peer_samples import LoaderPeer, read_rows

INSTALL = (
    "not installed: pip install --no-deps litdata==0.2.76 obstore==0.12.1 (never a plain "
    "install: it replaces torch)"
)
NAME = "litdata StreamingDataset, StreamingDataLoader"


def available() -> bool:
    """Whether litdata imports here."""
    try:
        import litdata  # noqa: F401
    except ImportError:
        return False
    return True


def rows_of(item: tuple[str, int, int]) -> Any:
    """``optimize`` fn: the samples of one block of the HDF5 file's rows (module level: its
    workers import it)."""
    path, start, end = item
    yield from read_rows(Path(path), start, end)


def build(source: Path, out: Path, count: int, chunk_bytes: str = "64MB") -> None:
    """Writes the HDF5 file's ``count`` rows with litdata's ``optimize`` into ``out``."""
    from litdata import optimize

    from benchmarks.packing import _quiet

    shutil.rmtree(out, ignore_errors=True)
    items = [(str(source), start, min(count, start + 1024)) for start in range(0, count, 1024)]
    with _quiet(out.parent / "litdata.log"):
        optimize(
            fn=rows_of,
            inputs=items,
            output_dir=str(out),
            num_workers=2,
            chunk_bytes=chunk_bytes,
            mode="overwrite",
            start_method="fork",
            verbose=False,
            reorder_files=False,
        )


def _allow_http(endpoint: str) -> None:
    """Lets litdata's obstore path reach a plain-HTTP endpoint (the loopback test server).

    NOTE [ litdata's obstore over http:// ]
    litdata 0.2.76 fetches chunks with obstore when it is installed (its fast path, and its
    declared dependency), else with boto3. obstore refuses ``http://`` unless its client
    options allow it, and litdata takes those options from a module constant, not from
    ``storage_options``; so for an ``http://`` endpoint the benchmark adds ``allow_http`` to
    that constant (a peer's internals, touched here only).
    """
    if not endpoint.startswith("http://"):
        return
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


class LitdataPeer(LoaderPeer):
    """One litdata loader; ``epoch()`` and ``digest()`` as MDSPeer's."""

    def __init__(self, config: dict) -> None:
        if not available():
            raise ImportError(INSTALL)
        from litdata import StreamingDataLoader, StreamingDataset

        options: dict[str, Any] = {"shuffle": True}
        if config.get("remote"):
            _allow_http(config["endpoint"])
            options.update(
                cache_dir=config["local"],
                max_cache_size=config.get("cache_limit"),
                storage_options={"endpoint_url": config["endpoint"]},
            )
        source = config.get("remote") or config["local"]
        dataset = StreamingDataset(source, **options)
        workers = config["workers"]
        self.fields = tuple(config["fields"])
        self.loader = StreamingDataLoader(
            dataset,
            batch_size=config["batch"],
            num_workers=workers,
            persistent_workers=workers > 0,
        )
