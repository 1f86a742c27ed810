"""Packing a folder of images, or any map-style dataset, into one LMDB or HDF5 file.

``pack.py`` (``pack()``: job -> encode in workers -> one writer, NOTE [ Atomic packing ]),
``jobs.py`` (what to pack: a folder scanned in ImageFolder order, or a dataset), ``options.py``
(``check_options``: the one check of the options, for ``pack()`` and the CLI), ``summary.py``,
``worker.py`` (the encode stage, in worker processes), ``pool.py`` (the worker pool: in order,
supervised), ``process.py`` (processes, signals, partial files), ``fields.py`` (samples of many
fields), ``output.py`` (the atomic rename, a full disk), ``sharded.py`` (``shard_size=``:
many packs and a manifest, NOTE [ Packing shards ]).

May import: ``vision``, ``formats``, ``shards``, ``parent_death``; never ``loader``,
``datasets`` or torch at module level (the packer's workers must start fast).
"""

from fastloader.packing.options import check_options
from fastloader.packing.pack import BadImageError, pack, scan_image_folder
from fastloader.packing.summary import PackSummary

__all__ = ["BadImageError", "PackSummary", "check_options", "pack", "scan_image_folder"]
