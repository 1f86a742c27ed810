"""A torch upgrade that moves an internal fastloader relies on fails here, naming it.

See NOTE [ torch internals fastloader relies on ] in fastloader/loader/iterators/__init__.py.
"""

from __future__ import annotations

import torch

from fastloader import DataLoader
from fastloader.loader.iterators import torch_internals
from fastloader.loader.iterators.worker_pool import WorkerPoolIter


def test_every_torch_internal_we_call_is_there_with_the_arguments_we_pass():
    assert torch_internals.missing() == [], (
        f"torch {torch.__version__} moved internals fastloader relies on"
    )


def test_a_moved_internal_is_named(monkeypatch):
    from torch.utils.data._utils import worker

    def renamed_loop(dataset_kind, dataset):  # a torch that changed the worker loop
        pass

    monkeypatch.setattr(worker, "_worker_loop", renamed_loop)
    monkeypatch.delattr(worker, "_ResumeIteration")
    problems = torch_internals.missing()
    assert any("_worker_loop takes ('dataset_kind', 'dataset')" in p for p in problems)
    assert any("_ResumeIteration is gone" in p for p in problems)


def test_a_live_worker_pool_has_the_state_we_read():
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1)
    try:
        iterator = iter(loader)
        assert isinstance(iterator, WorkerPoolIter)
        assert torch_internals.missing_state(iterator) == []
        assert [batch.tolist() for batch in iterator] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        loader.close()


def _labels(events) -> list[str]:
    return [event.name for event in events if event.name.startswith("enumerate(DataLoader)")]


def test_the_profiler_still_sees_each_batch_of_the_main_process_loader():
    # NOTE [ The profiler label ]: the label is skipped only while no profiler runs
    loader = DataLoader(list(range(8)), batch_size=2)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        assert [batch.tolist() for batch in iterator] == [[2, 3], [4, 5], [6, 7]]
    assert len(_labels(profiler.events())) >= 3
    assert iterator._num_yielded == 4  # counted with and without the label
