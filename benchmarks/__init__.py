"""fastloader's benchmark suite: ``python -m benchmarks [--size tiny|quick|full]``.

Each comparison is a module with ``run(size, workdir) -> dict`` that measures, in one run on the
same data, fastloader against torch's DataLoader (or the image folder, or litdata) and returns
rows, ratios and notes (see ``report.py`` for the shape):

- ``loader``: epoch-start stall, steady throughput, start-up-cost dataset, seeding overhead;
- ``formats``: read throughput of LMDB/HDF5 packs in each store mode vs the image folder;
- ``packing``: ``fastloader.pack`` throughput vs litdata's ``optimize``, and reading back;
- ``memory``: worker memory over epochs, packed datasets vs the image folder;
- ``gpu_step``: a GPU training step fed by each loader (skipped without CUDA).

The data is made at run time from the photos scikit-image ships (``_photos.py``).
"""

COMPARISONS = ("loader", "formats", "packing", "memory", "gpu_step", "supervision")
SIZES = ("tiny", "quick", "full")
