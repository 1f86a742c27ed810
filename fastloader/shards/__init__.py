"""Sharded packs: a dataset as many ordinary packs (shards) plus a manifest, local or remote.

``manifest.py`` (the manifest: written last, parsed as untrusted input, NOTE [ The shard
manifest ]), ``sizes.py`` (``"64MB"`` and friends), ``stores.py`` (where shards live: a
folder or an object store, and ``open_store``), ``s3.py`` (the S3 client: NOTE [ One client
per process ]), ``cache.py`` (the node-local cache: NOTE [ The shard cache ]),
``cache_counters.py`` (what each process's cache did, by ``process_key``), ``inspect.py``
(``--info`` and ``--verify`` of a sharded pack). The shard-aware order lives with the other
orders in ``sampling/shard_order.py``; the torch dataset in ``datasets/sharded.py``.

Torch-free. May import: the standard library, NumPy, xxhash, ``formats`` (and boto3, lazily,
only when a URL needs it).
"""
