"""Which samples, in which order: samplers whose order is a function of (seed, epoch).

``seeds.py`` (the pure seed derivations every order and every sample's RNGs start from),
``choice.py`` (which sampler a loader reads its dataset with: NOTE [ Choosing the order ]),
``samplers.py`` (shuffles and block shuffles by (seed, epoch)), ``distributed.py``
(NOTE [ Global order ]: one global order cut across ranks, exactly-once evaluation), and
weighted mixing of named sources: ``mix.py`` (``Mix``, the dataset, and NOTE [ Weight
changes ]), ``mix_order.py`` (NOTE [ The mixed order as a pure function ]), ``interleave.py``
(NOTE [ The interleave ]), ``permutation.py`` (NOTE [ Permutations on the fly ]),
``mix_samplers.py`` (the mix cut into epochs and across ranks) and ``mix_state.py`` (NOTE
[ Resuming a mix whose sources changed ]); ``shard_order.py`` (NOTE [ The shard-aware order ]:
the order of a sharded pack, each rank on its own shards).

May import: torch, NumPy, and nothing of fastloader outside ``sampling/``.
"""
