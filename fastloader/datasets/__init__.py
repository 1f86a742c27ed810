"""torch datasets over packs and users' own files, and the collate helpers for their samples.

``packs.py`` (LMDBDataset, HDF5Dataset, open_pack), ``field_samples.py`` (a pack of any sample:
records back to dicts), ``users_files.py`` (HDF5FileDataset, LMDBFileDataset: users' files read
in place), ``collate.py`` (ragged fields as lists or padded), ``sharded.py``
(``ShardedDataset``: a sharded pack, local or remote, as one dataset).

May import: ``vision``, ``device``, ``formats``, ``shards``; never ``loader``, ``packing`` or
``sampling``.
"""
