"""Which samples, in which order: samplers whose order is a function of (seed, epoch).

``seeds.py`` (the pure seed derivations every order and every sample's RNGs start from),
``samplers.py`` (shuffles and block shuffles by (seed, epoch)), ``distributed.py``
(NOTE [ Global order ]: one global order cut across ranks, exactly-once evaluation).

May import: torch, NumPy, and nothing of fastloader outside ``sampling/``.
"""
