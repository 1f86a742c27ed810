"""The torch internals fastloader relies on, by name and by the signature we call.

See NOTE [ torch internals fastloader relies on ] in __init__.py. ``missing()`` compares this
list with the installed torch; tests/test_torch_internals.py runs it (and checks the instance
state of live iterators), so a torch upgrade that moves anything fails with a message naming
what moved instead of somewhere deep in a worker.
"""

from __future__ import annotations

import inspect
from typing import Any

# (module, attribute path, the parameters we pass, or None when only the name matters)
CALLED: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("torch.utils.data.dataloader", "_SingleProcessDataLoaderIter", None),
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter", None),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__", ("self",)),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter._reset", ("self", "loader", "first_iter")),
    ("torch._C._autograd", "_profiler_enabled", None),
    ("torch.utils.data.dataloader", "_DatasetKind.Map", None),
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter._next_index", ("self",)),
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter._next_data", ("self",)),
    (
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter._reset",
        ("self", "loader", "first_iter"),
    ),
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter._try_put_index", ("self",)),
    (
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter._process_data",
        ("self", "data", "worker_idx"),
    ),
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter._get_data", ("self",)),
    (
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter._try_get_data",
        ("self", "timeout"),
    ),
    (
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter._shutdown_workers",
        ("self",),
    ),
    (
        "torch.utils.data._utils.worker",
        "_worker_loop",
        (
            "dataset_kind",
            "dataset",
            "index_queue",
            "data_queue",
            "done_event",
            "auto_collation",
            "collate_fn",
            "drop_last",
            "base_seed",
            "init_fn",
            "worker_id",
            "num_workers",
            "persistent_workers",
            "shared_seed",
        ),
    ),
    ("torch.utils.data._utils.worker", "_ResumeIteration", None),
    (
        "torch.utils.data._utils.fetch",
        "_MapDatasetFetcher.fetch",
        ("self", "possibly_batched_index"),
    ),
    ("torch.utils.data._utils.worker", "WorkerInfo", None),
    ("torch.utils.data._utils.signal_handling", "_remove_worker_pids", None),
    ("torch.utils.data._utils", "MP_STATUS_CHECK_INTERVAL", None),
    ("torch.utils.data._utils.collate", "collate", ("batch", "collate_fn_map")),
    ("torch.utils.data._utils.collate", "collate_tensor_fn", ("batch", "collate_fn_map")),
    ("torch.utils.data._utils.collate", "default_collate_fn_map", None),
    ("torch.utils.data._utils.collate", "default_collate", None),
    ("torch.utils.data.dataloader", "DataLoader._index_sampler", None),
)

# State of a live ``_MultiProcessingDataLoaderIter`` that we read or write (and the loader's
# ``_dataset_kind``, set in torch's DataLoader.__init__).
POOL_STATE = (
    "_dataset",
    "_worker_init_fn",
    "_send_idx",
    "_rcvd_idx",
    "_task_info",
    "_tasks_outstanding",
    "_prefetch_factor",
    "_in_order",
    "_workers",
    "_index_queues",
    "_worker_result_queue",
    "_workers_done_event",
    "_workers_status",
    "_base_seed",
    "_shared_seed",
    "_worker_pids_set",
    "_shutdown",
    "_num_workers",
    "_num_yielded",
    "_sampler_iter",
    "_timeout",
    "_dataset_kind",
    "_auto_collation",
    "_collate_fn",
    "_drop_last",
    "_persistent_workers",
)


def _resolve(module: str, path: str) -> Any:
    value: Any = __import__(module, fromlist=["_"])
    for part in path.split("."):
        value = getattr(value, part)
    return value


def missing() -> list[str]:
    """What of ``CALLED`` the installed torch lacks or calls differently (empty when all is
    in place), one line each, naming the internal."""
    problems = []
    for module, path, params in CALLED:
        try:
            value = _resolve(module, path)
        except (ImportError, AttributeError):
            problems.append(f"{module}.{path} is gone")
            continue
        if params is None:
            continue
        try:
            found = tuple(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            continue
        if found != params:
            problems.append(f"{module}.{path} takes {found}, fastloader passes {params}")
    return problems


def missing_state(iterator: Any) -> list[str]:
    """The names of ``POOL_STATE`` that a live pool iterator does not have."""
    return [name for name in POOL_STATE if not hasattr(iterator, name)]
