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
- ``cheap``: samples that cost microseconds (an index, CIFAR-like tensors, token windows from a
  memmap) and the loaders' own cost per batch, with 0 and 2 workers.
- ``oom``: packs vs files read from cold storage (evicted from the page cache, in a memory
  cgroup where possible), with and without the packs' read advice.
- ``mix``: ``fastloader.Mix`` vs the same sources concatenated (index and token samples, 2
  workers), and the mixed order's own costs (mapping, a far resume, state, memory).
- ``any_sample``: a user's pose-style HDF5 file read in place by ``HDF5Dataset`` vs a
  hand-written h5py Dataset (and, with mosaicml-streaming, a pack of fields vs MDS).
- ``transport``: batches from workers to the main process (pose HDF5 fields, token windows,
  an index, decoded images) with 0, 1 and 2 workers, and the main process's CPU per batch.
- ``remote``: sharded packs: the shard-aware order's shuffle vs a global one, downloads per
  node of a simulated 64-node cluster, and epochs from S3 (SeaweedFS on loopback), cold and
  warm, vs one local pack.

The data is made at run time from the photos scikit-image ships (``_photos.py``).
"""

#: Every comparison, in the order a run goes through them -> whether the ~1-minute demo
#: (``--quick``, the default) runs it. ``--size full`` and ``tiny`` run them all. A new
#: comparison is one line here (and its usual duration in ``__main__.EXPECTED_SECONDS``).
COMPARISONS = {
    "pipeline": True,
    "loader": True,
    "formats": False,
    "packing": False,
    "memory": False,
    "gpu_step": False,
    "distributed": False,
    "cli_startup": False,
    "supervision": False,
    "cheap": False,
    "oom": False,
    "any_sample": False,
    "mix": False,
    "transport": True,
    "threads": False,
    "remote": False,
}
DEMO = tuple(name for name, in_demo in COMPARISONS.items() if in_demo)
SIZES = ("tiny", "quick", "full")
