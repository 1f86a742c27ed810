"""The cross-epoch schedule and the epoch cursor, alone (no torch iterator, no workers).

See NOTE [ Cross-epoch prefetch ] in fastloader/loader/schedule.py and NOTE [ The epoch cursor ] in
fastloader/loader/cursor.py.
"""

from __future__ import annotations

import pytest
from torch.utils.data import BatchSampler

from fastloader.loader.cursor import EpochCursor
from fastloader.loader.schedule import EpochSchedule


class EpochOrder:
    """A sampler whose order is a function of the epoch: 0..n-1 rotated by the epoch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter([(i + self.epoch) % self.n for i in range(self.n)])

    def __len__(self) -> int:
        return self.n


def _schedule(n: int = 5, batch_size: int = 2, may_cross: bool = True):
    sampler = EpochOrder(n)
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    return EpochSchedule(batches, sampler.set_epoch, may_cross), sampler


def _drain(schedule: EpochSchedule, count: int) -> list[tuple[int, list[int]]]:
    tasks = []
    for _ in range(count):
        task = schedule.next_task()
        tasks.append((task.epoch, list(task.indices)))
    return tasks


def test_tasks_run_on_into_the_next_epoch_with_its_own_order():
    schedule, _ = _schedule()
    schedule.start(0)
    assert _drain(schedule, 5) == [
        (0, [0, 1]),
        (0, [2, 3]),
        (0, [4]),
        (1, [1, 2]),
        (1, [3, 4]),
    ]
    assert schedule.lengths[0] == 3  # known as soon as epoch 0's last task was sent


def test_the_length_of_an_epoch_is_known_when_its_last_task_is_sent():
    schedule, _ = _schedule()
    schedule.start(0)
    _drain(schedule, 2)
    assert 0 not in schedule.lengths
    _drain(schedule, 1)
    assert schedule.lengths == {0: 3}  # before any task of epoch 1 was asked for


def test_without_crossing_the_schedule_stops_at_the_end_of_the_epoch():
    schedule, _ = _schedule(may_cross=False)
    schedule.start(3)
    assert _drain(schedule, 3) == [(3, [3, 4]), (3, [0, 1]), (3, [2])]
    with pytest.raises(StopIteration):
        schedule.next_task()


def test_tasks_stop_at_the_last_epoch_asked_for_and_go_on_when_it_moves():
    schedule, _ = _schedule(n=4, batch_size=2)
    schedule.start(0)
    sent = [schedule.next_task(last_epoch=1).epoch for _ in range(4)]
    assert sent == [0, 0, 1, 1]
    with pytest.raises(StopIteration):
        schedule.next_task(last_epoch=1)  # epoch 2 only once the consumer is in epoch 1
    assert schedule.next_task(last_epoch=2).epoch == 2


def test_a_start_position_skips_samples_of_the_order_and_counts_them():
    schedule, _ = _schedule(n=6)
    schedule.start(0, skip=3)
    assert _drain(schedule, 2) == [(0, [3, 4]), (0, [5])]
    assert schedule.lengths[0] == 3 + 2


def test_finish_epoch_counts_what_was_never_sent():
    schedule, _ = _schedule(n=9)
    schedule.start(0)
    _drain(schedule, 1)
    schedule.finish_epoch()
    assert schedule.lengths[0] == 5


def test_the_cursor_moves_on_resumes_and_follows_a_users_epoch():
    cursor = EpochCursor()
    assert cursor.begin() == (0, 0)
    cursor.consumed_batch()
    cursor.consumed_batch()
    assert cursor.position(step=4, length=10) == 8
    assert cursor.position(step=4, length=6) == 6  # capped at the epoch's length
    cursor.finished()
    assert cursor.complete
    assert cursor.begin() == (1, 0)  # a started epoch is followed by the next
    assert cursor.begin(requested=7) == (7, 0)  # the user's sampler.set_epoch wins
    cursor.resume_at(3, 40)
    assert (cursor.started, cursor.position(step=4, length=None)) == (False, 0)
    assert cursor.begin() == (3, 40)
    cursor.consumed_batch()
    assert cursor.position(step=4, length=None) == 44
    cursor.jump_to(9)
    assert cursor.begin() == (9, 0)
