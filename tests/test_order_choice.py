"""One place chooses the loader's order (NOTE [ Choosing the order ] in sampling/choice.py): a
dataset with an order of its own plugs in through ``OwnOrder``, a user's sampler still wins."""

import pytest
from torch.utils.data import Dataset, SequentialSampler

from fastloader import DataLoader
from fastloader.sampling.samplers import EpochShuffleSampler


class Reversed(Dataset):
    """Brings its own order (last sample first), as a ``Mix`` does, and records what it was
    asked with."""

    def __init__(self, n: int = 6) -> None:
        self.n = n
        self.asked = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def loader_sampler(self, *, distributed, shuffle, batch_size, drop_last, seed):
        self.asked = dict(distributed=distributed, shuffle=shuffle, batch_size=batch_size)
        self.asked.update(drop_last=drop_last, seed=seed)
        return list(reversed(range(self.n)))


def test_a_dataset_with_its_own_order_gives_the_sampler():
    dataset = Reversed()
    loader = DataLoader(dataset, batch_size=4, shuffle=True, drop_last=True, seed=9)
    assert [batch.tolist() for batch in loader] == [[5, 4, 3, 2]]
    assert dataset.asked == {
        "distributed": False,
        "shuffle": True,
        "batch_size": 4,
        "drop_last": True,
        "seed": 9,
    }
    assert loader.last_indices == [5, 4, 3, 2]


def test_a_users_sampler_wins_over_the_datasets_order():
    dataset = Reversed()
    loader = DataLoader(dataset, batch_size=3, sampler=SequentialSampler(dataset))
    assert [batch.tolist() for batch in loader] == [[0, 1, 2], [3, 4, 5]]
    assert dataset.asked is None


@pytest.mark.parametrize("shuffle", [True, False])
def test_plain_datasets_get_the_seeded_shuffle_or_torchs_sequence(shuffle):
    loader = DataLoader(list(range(10)), batch_size=5, shuffle=shuffle, seed=3)
    kind = EpochShuffleSampler if shuffle else SequentialSampler
    assert type(loader.sampler) is kind
    assert getattr(loader.sampler, "seed", 3) == 3
