"""fastloader's benchmark suite: ``python -m benchmarks [--size tiny|quick|full]``.

Each comparison is a module with ``run(size, workdir) -> dict`` that measures, in one run on the
same data, fastloader against torch's DataLoader (or the image folder, or litdata) and returns
rows, ratios and notes (see ``report.py`` for the shape):

- ``pipeline``: the training pipeline (random-resized crop + flip) through every loader and
  pack, plain and fused, against torch, DALI on CPU and SPDL (the headline);
- ``loader``: epoch-start stall, steady throughput, start-up-cost dataset, seeding overhead;
- ``formats``: read throughput of LMDB/HDF5 packs in each store mode vs the image folder;
- ``packing``: ``fastloader.pack`` throughput vs litdata's ``optimize``, and reading back;
- ``memory``: worker memory over epochs, packed datasets vs the image folder;
- ``gpu_step``: a GPU training step fed by each loader (skipped without CUDA);
- ``distributed``: the global order of ``distributed=True`` vs DistributedSampler, state size;
- ``cli_startup``: how fast ``fastloader-pack`` answers (``--help``, ``--info``, a usage
  error) and how much of a small pack's wall time is not packing;
- ``supervision``: time from a worker's death to the next batch, throughput with and without
  worker supervision;
- ``any_sample``: a user's pose-style HDF5 file read in place by ``HDF5Dataset`` vs a
  hand-written h5py Dataset (and, with mosaicml-streaming, a pack of fields vs MDS).

The data is made at run time from the photos scikit-image ships (``_photos.py``).
"""

COMPARISONS = (
    "pipeline",
    "loader",
    "formats",
    "packing",
    "memory",
    "gpu_step",
    "distributed",
    "cli_startup",
    "supervision",
    "any_sample",
)
SIZES = ("tiny", "quick", "full")
