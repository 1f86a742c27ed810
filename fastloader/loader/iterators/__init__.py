"""Iterator subclasses of torch's: the only place fastloader touches torch's DataLoader internals.

- ``common.py``: what both iterators add (the seeded dataset, the loader's bookkeeping, the
  device copy) and ``SingleProcessIter`` (``num_workers=0``);
- ``worker_pool.py``: ``WorkerPoolIter``, worker processes kept across epochs, fed ahead
  (NOTE [ Cross-epoch prefetch ] in loader/schedule.py) and supervised (NOTE [ Supervised
  workers ] in loader/supervision.py);
- ``slot_collate.py``: torch's ``default_collate`` stacking straight into a shared-memory slot
  (runs in the workers; NOTE [ Batch transport ] in loader/transport/__init__.py);
- ``pool_healing.py``: supervision's half of the pool (finding dead workers, replacing them);
- ``worker_loop.py``: in each worker, torch's loop given a task queue read through
  ``BufferedGet`` (NOTE [ Puts without a feeder thread ] in loader/transport/pipes.py);
- ``torch_internals.py``: the list of what we rely on, checked against the installed torch.

Everything here runs in the main process, except what torch's worker loop runs with the
objects built here (the seeded dataset wrappers, ``WorkerInit``, the slot collate).

NOTE [ torch internals fastloader relies on ]

Every touch of torch's private DataLoader machinery is in this package. Tested with torch
2.13.0 and 2.14.1 (the range pinned in pyproject.toml). We subclass
``_SingleProcessDataLoaderIter`` and ``_MultiProcessingDataLoaderIter`` (so ``iter(loader)``
is torch's iterator, ``_BaseDataLoaderIter``) and rely on:

- ``_BaseDataLoaderIter.__init__`` assigning ``self._dataset`` and ``self._collate_fn`` and
  the multiprocessing iterator reading ``self._worker_init_fn`` and ``self._collate_fn`` before
  it starts workers: they are properties here, so workers receive the seeded wrapper,
  fastloader's init function and the slot collate (NOTE [ Batch transport ]); and it
  assigning ``self._worker_result_queue`` after ``_worker_init_fn`` and before starting
  workers (a property too: the init function learns the queue each worker writes without a
  feeder thread, NOTE [ Puts without a feeder thread ]; checked by tests/test_pipes.py);
- ``_utils.collate.collate`` with a ``collate_fn_map``, ``collate_tensor_fn``,
  ``default_collate_fn_map`` and ``default_collate`` (the loader's default, recognised by
  identity): the slot collate is torch's collate with the tensor rule replaced;
- ``_BaseDataLoaderIter.__next__`` (profiler label, ``_num_yielded``), called around our
  bookkeeping; for map-style datasets with no profiler on, its body without the label
  (``_sampler_iter``, ``_reset``, ``_next_data``, ``_num_yielded``; NOTE [ The profiler
  label ] in common.py, checked by tests/test_torch_internals.py);
- ``_next_index()`` being the only place indices are drawn (``_try_put_index`` treats its
  StopIteration as "nothing to send now"), called just before a task is sent as
  ``(self._send_idx, task)``;
- ``_next_data()``, ``_reset(loader)``, ``_try_put_index()``, ``_process_data()``,
  ``_get_data()``, ``_try_get_data()``, ``_shutdown_workers()`` and the state ``_send_idx``,
  ``_rcvd_idx``, ``_task_info``, ``_tasks_outstanding``, ``_prefetch_factor`` (also set:
  from the first batch's bytes, NOTE [ Prefetch depth by batch bytes ]; lower once batches
  travel in groups and back after a worker's death, NOTE [ Batches per message ]; our
  ``_try_put_index`` puts nothing while torch's assertion that fewer tasks are outstanding
  than it allows would fail), ``_in_order``,
  ``_workers``, ``_index_queues``, ``_worker_result_queue``, ``_workers_done_event``,
  ``_workers_status``, ``_base_seed``, ``_shared_seed``, ``_worker_pids_set``, ``_shutdown``;
- ``_utils.worker._worker_loop`` calling ``init_fn(worker_id)`` from its own frame before its
  loop, with its task queue in the local ``index_queue``, read only through ``.get``
  (``worker_loop.py`` gives that queue its own ``get``; tests/test_pipes.py checks it under
  fork and spawn);
- ``_utils.worker._worker_loop``'s argument list (replacement workers are started with it),
  ``_utils.worker._ResumeIteration``, and ``_utils.signal_handling._remove_worker_pids``
  (see NOTE [ Supervised workers ] in loader/supervision.py);
- ``_utils.fetch._MapDatasetFetcher.fetch`` handing the task it is given to the dataset's
  ``__getitems__`` as it is and that result to ``collate_fn``, and the worker loop wrapping
  an exception of either as the task's result: a ``TaskGroup`` becomes a ``LoadedGroup``
  and then ``Batches`` that way (NOTE [ Batches per message ]);
- ``torch.utils.data._utils.worker.WorkerInfo`` being a plain object whose ``dataset`` we
  point back at the user's dataset.

What does not touch torch internals lives outside: the schedule (loader/schedule.py), the epoch
cursor (loader/cursor.py), the supervision policy (loader/supervision.py), what runs in workers
(loader/worker_guard.py, loader/result_queue.py). ``torch_internals.py`` lists each name with the
signature we call, and tests/test_torch_internals.py fails naming what moved on a torch
upgrade.

See NOTE [ Cross-epoch prefetch ] in loader/schedule.py for how tasks run ahead into the next epoch.
"""

from fastloader.loader.iterators.common import SingleProcessIter, order_is_predictable
from fastloader.loader.iterators.worker_pool import WorkerPoolIter

__all__ = ["SingleProcessIter", "WorkerPoolIter", "order_is_predictable"]
