"""Batches from worker processes to the main process through reusable shared-memory slots.

Who runs what: ``slots.py`` is the memory and its table (both sides), ``send.py`` runs in the
workers, ``receive.py`` in the main process, ``forks.py`` at every fork of a process holding
batches, ``pipes.py`` writes the queues' messages (tasks, descriptors) in the calling thread on
both sides (NOTE [ Puts without a feeder thread ]).
Imports: torch, NumPy, the standard library and ``fastloader.datasets.collate`` (stacking).

NOTE [ Batch transport ]

torch sends each batch through the result queue's pipe: pickled, with every tensor moved into
a shared-memory segment of its own (created, sized, mapped, its file descriptor passed through
the worker's ``resource_sharer`` thread and mapped again in the main process), and NumPy
arrays pickled into the pipe byte by byte. With cheap samples that costs more than the
loading (issue 30: 2-3 ms of main-process CPU per batch of 64 images, 0.2x the in-process
rate for a user's HDF5 fields). Here a batch costs one copy, made in the worker:

* **Slots.** Before it starts workers, the pool makes one anonymous shared-memory file per
  worker slot (``memfd_create``: it has no name, in /dev/shm or anywhere, so no death of any
  process can leave one behind; the kernel frees it when the last process holding it goes).
  Workers inherit it (fork) or receive it with their arguments (spawn, forkserver:
  multiprocessing's ``DupFd``); a replacement worker gets the same file. The file is a header
  page, a table of ``ROWS`` rows ``(state, offset, capacity)``, and regions after it. Regions
  are made by the worker on demand: the first batch sizes the first one (plus 1/8 for ragged
  batches), a batch that fits no free region gets a bigger one (the biggest free region too
  small is handed back to the system, ``MADV_REMOVE``, and its row gets the new one; a row
  never used only when every region is in use: batches that grow over an epoch once left a
  region of each size behind, 64 rows and 94 MB per worker where 9 rows and 18 MB now
  serve, tests/test_transport_round4.py), so memory in use is about
  (batches in flight + batches the user holds) x batch bytes per worker: with the default
  depth (NOTE [ Prefetch depth by batch bytes ]: 2 to 8 batches in flight, about 32 MB of
  them per worker) and a training loop that drops each batch, depth + 1-2 regions.
* **Writing, and the commit.** The worker runs torch's own worker loop; only the collate
  function is wrapped (``SlotCollate``: torch's loop, fetchers, seeding, ``worker_init_fn``
  and error wrapping stay torch's, and owning the loop would buy little: the loop's own cost
  is a queue get and put per batch, the put written without the feeder thread, NOTE [ Puts
  without a feeder thread ] in pipes.py). It collates, finds a FREE row with room,
  marks it WRITING, writes every array leaf of the batch into the region (with torch's
  ``default_collate`` the samples are stacked straight into the region: ``Stack`` in the
  iterators' collate hook, no intermediate batch tensor; a user's HDF5 file read by columns
  has its mapped fields gathered straight into it: ``Gather``, NOTE [ Batches read by
  columns ] in datasets/columns.py), marks the row READY, and only then
  returns a ``SlotBatch``: the row, its offset and capacity, the layout (dtype, shape, offset
  of each leaf) and the skeleton of the batch with the non-array leaves (strings, numbers in
  lists, user objects), which is all that is pickled. A worker killed before READY has sent
  nothing: no half batch can be delivered. Its replacement frees the rows left WRITING
  (``reclaim_torn``) and supervision re-sends the task (NOTE [ Supervised workers ]).
  A descriptor is a few hundred bytes (plus the non-array leaves: 64 file names add ~1.5
  KB), written to the pipe in one ``write`` (atomic up to PIPE_BUF, 4 KB), so the result pipe
  rarely carries a message that can tear; NOTE [ Torn results ] still guards the rest and
  batches that travel the old way. A worker killed after READY and before its descriptor is
  written leaves that row READY with nobody to free it: when supervision replaces the worker,
  the main process frees every READY row of that worker slot that no batch of its holds
  (``receive.reclaim_unsent``). A descriptor of such a row may still be in the pipe; each
  ``acquire`` counts the row's generation (the table's fourth column) and a descriptor names
  the generation it was written in, so ``rebuild`` turns a descriptor whose row was reclaimed
  (FREE, or taken again) into ``STALE``, dropped like a duplicate (its task was sent again
  with the dead worker's others). The check and the taking of a row hold ``rows_lock``, as
  does the reclaim (the pin-memory thread rebuilds while the main thread heals).
* **Descriptors.** A batch's layout is the same from batch to batch (same fields, dtypes,
  shapes), and pickling its dtypes was a third of a descriptor's cost. Each worker keeps the
  pickle of the layouts it sent (``SlotCollate._described``) and sends those bytes; the main
  process keeps each pickle's unpickled layout (``receive._layouts``). Both keep a bounded
  number, so ragged batches (a new layout each) only lose the saving. The worker writes leaves
  through NumPy views of the region where it can (``Gather``, stacked arrays, arrays), and
  ``acquire`` tries the row after the last one taken (on a tight fit) before searching the
  table.
* **Reading, zero copy.** Unpickling a ``SlotBatch`` in the main process (wherever torch
  unpickles: the main thread, or the pin-memory thread) calls ``receive.rebuild``: it maps
  the region once (cached per row), wraps it in one buffer object per batch, and makes every
  leaf a tensor or array *view* of it (``np.ndarray`` over that object, and
  ``torch.from_numpy`` of it; ``torch.frombuffer`` for dtypes NumPy lacks). Nothing is
  copied in the main process: the main-process cost is the same for 2 KB and 10 MB batches.
* **Slot lifetime.** The per-batch buffer object carries a finalizer that marks the row FREE.
  Every view (and every view of a view, ``.numpy()``, slices) keeps that object alive, so a
  row returns to its worker exactly when no tensor or array of the user's points into it:
  a user who keeps batches (``list(loader)``), or hands one to another process (see "A batch
  in another process" below), always sees correct data. Each
  side writes only its own transitions (worker FREE->WRITING->READY, main READY->FREE), so
  no lock is shared between processes. Only the process that rebuilt the batch frees its row:
  a process forked from it holds copies of the same objects, and their end frees nothing.
  Copying out in the main process instead (and freeing the row at once) would cost a copy
  of every batch in the process that drives the GPU: for 3x224x224 uint8 batches of 64 that
  is 9.6 MB, about 1-3 ms on the 2-core box against ~0.1 ms to wrap, so batches are wrapped,
  not copied. When every row of a worker is held (a user keeping more than ``ROWS`` batches
  per worker), batches travel torch's way until rows come back: correct, only slower.
* **A batch in another process.** The rule: a batch's values hold for as long as *any*
  process holds it. A batch pickled to another process (a ``multiprocessing`` queue, a spawn
  or forkserver child's arguments) is copied by the pickling: torch moves a tensor's storage
  into new shared memory, NumPy pickles its bytes; the row is then freed when this process's
  views die, and the other process never saw it. A *forked* child is different: it inherits
  the mapping itself (``MAP_SHARED``), and once this process drops the batch the row is
  freed and a worker writes a later batch into memory the child still reads (issue 39: the
  child's ``[0..3]`` became ``[216..219]``). So ``forks.py`` registers ``os.register_at_fork``
  hooks: before a fork, under ``rows_lock``, the rows this process holds (``SlotFile.live``,
  kept by ``rebuild`` and its finalizer: one dict entry per batch) are noted; in the child,
  each held region's pages are replaced by private copies (an anonymous mapping, copied and
  moved over them with ``mremap``: the child's views keep their addresses and values); the
  parent waits for the child's word before going on, so no row is freed before the copy is
  made (a child that cannot copy or does not answer within ``COPY_WAIT_S``: those rows are
  never freed). Forks that start the pool's own workers skip it (``workers_starting``: they
  read no batch of the parent). Cost: none for a process that holds no batch or never forks;
  a fork while batches are held pays one copy of their bytes, in the child.
* **What does not go through slots.** Leaves that are not plain CPU tensors or NumPy arrays
  of a plain dtype (tensor subclasses, tensors that require grad, sparse, conjugate or
  quantized tensors, object arrays) and containers other than list, tuple, dict and
  namedtuples travel inside the skeleton, pickled as torch would.
* **With ``device``.** The batch the device prefetcher receives is already a set of views of
  the slot: pinning copies it once into pinned memory (the only host copy), and the slot is
  freed as soon as the pinned copy exists.

* **Several batches per message.** Once batches prove cheap, consecutive batches of an epoch
  travel as one task, one slot region and one descriptor (NOTE [ Batches per message ] in
  ``groups.py``).

``WorkerPoolIter.slots = False`` sends batches torch's way (benchmarks/transport.py compares
both).
"""
