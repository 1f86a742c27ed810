"""fastloader.device: device resolution, structure-preserving moves, the device prefetcher."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch

from fastloader.device import DevicePrefetcher, move_to_device, pin, resolve_device
from fastloader.vision.transforms import Normalize

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")

Pair = namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    name: str
    extra: dict


class Counting:
    """An iterable of ``n`` tensor batches that records how many were pulled."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0
        self.passes = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.passes += 1
        for i in range(self.n):
            self.pulled += 1
            yield torch.full((2,), i)


def _values(batches) -> list[int]:
    return [int(b[0]) for b in batches]


# -- resolve_device ---------------------------------------------------------------------------


def test_resolve_device_accepts_none_cpu_strings_and_devices():
    assert resolve_device(None) is None
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "cuda:-1"])
def test_resolve_device_rejects_bad_strings_naming_the_argument(bad):
    with pytest.raises(ValueError, match="device="):
        resolve_device(bad)


@pytest.mark.parametrize("other", ["mps", "meta", torch.device("meta")])
def test_resolve_device_rejects_unsupported_device_types(other):
    with pytest.raises(ValueError, match="not supported"):
        resolve_device(other)


@pytest.mark.parametrize("bad", [0, 1.0, ["cuda"], True])
def test_resolve_device_rejects_non_device_types(bad):
    with pytest.raises(TypeError, match="device must be"):
        resolve_device(bad)


@no_cuda
@pytest.mark.parametrize(
    "cuda", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["bare", "indexed", "torch-device"]
)
def test_resolve_device_cuda_without_cuda_says_so(cuda):
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
        resolve_device(cuda)


@pytest.mark.cuda
@needs_cuda
def test_resolve_device_rejects_cuda_index_past_visible_devices():
    count = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=f"only {count} CUDA device"):
        resolve_device(f"cuda:{count}")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


# -- move_to_device / pin ---------------------------------------------------------------------
# The meta device makes a move observable without a GPU: every moved tensor reports it.


def test_move_to_device_moves_tensors_in_every_container_and_keeps_other_leaves():
    array = np.arange(3)
    extra = {"ids": torch.arange(2), "note": None}
    batch = {
        "tuple": (torch.ones(2), "a", 3),
        "list": [torch.zeros(1), [torch.ones(1)], None],
        "pair": Pair(torch.ones(2), 7),
        "sample": Sample(torch.ones(3), "x", extra),
        "array": array,
    }
    moved = move_to_device(batch, "meta")

    assert type(moved) is dict and list(moved) == list(batch)
    assert type(moved["tuple"]) is tuple and moved["tuple"][1:] == ("a", 3)
    assert moved["tuple"][0].device.type == "meta"
    assert type(moved["list"]) is list and moved["list"][2] is None
    assert moved["list"][0].is_meta and moved["list"][1][0].is_meta
    assert type(moved["pair"]) is Pair and moved["pair"].image.is_meta and moved["pair"].label == 7
    sample = moved["sample"]
    assert type(sample) is Sample and sample.image.is_meta and sample.name == "x"
    assert sample.extra["ids"].is_meta and sample.extra["note"] is None
    assert moved["array"] is array
    # The input is left as it was.
    assert batch["tuple"][0].device.type == "cpu" and extra["ids"].device.type == "cpu"


def test_move_to_device_keeps_mapping_types():
    ordered = OrderedDict([("b", torch.ones(1)), ("a", torch.ones(1))])
    default = defaultdict(list, {"x": torch.ones(1)})
    moved_ordered = move_to_device(ordered, "meta")
    moved_default = move_to_device(default, "meta")
    assert type(moved_ordered) is OrderedDict and list(moved_ordered) == ["b", "a"]
    assert moved_ordered["a"].is_meta
    assert type(moved_default) is defaultdict and moved_default.default_factory is list
    assert moved_default["x"].is_meta


def test_move_to_device_on_a_bare_tensor_and_a_non_tensor():
    assert move_to_device(torch.ones(2), "meta").is_meta
    assert move_to_device("text", "meta") == "text"
    tensor = torch.ones(2)
    assert move_to_device(tensor, "cpu") is tensor


@no_cuda
def test_pin_without_cuda_returns_the_batch_unchanged():
    batch = (torch.ones(2), ["a"])
    assert pin(batch) is batch


# -- DevicePrefetcher on the CPU --------------------------------------------------------------


def test_prefetcher_yields_every_batch_in_order():
    prefetcher = DevicePrefetcher(Counting(7), "cpu", depth=2)
    assert _values(prefetcher) == list(range(7))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetcher_runs_depth_batches_ahead(depth):
    source = Counting(10)
    transformed = []

    def transform(batch):
        transformed.append(int(batch[0]))
        return batch

    iterator = iter(DevicePrefetcher(source, "cpu", depth=depth, transform=transform))
    for k in range(10):
        batch = next(iterator)
        assert int(batch[0]) == k
        # Batch k is out; batches up to k + depth are pulled and already transformed.
        expected = min(k + depth + 1, 10)
        assert source.pulled == expected
        assert transformed == list(range(expected))
    with pytest.raises(StopIteration):
        next(iterator)


def test_prefetcher_applies_the_transform_once_per_batch_in_order():
    prefetcher = DevicePrefetcher(Counting(5), "cpu", transform=lambda b: b * 10)
    assert _values(prefetcher) == [0, 10, 20, 30, 40]


def test_prefetcher_restarts_a_pass_per_iter_across_epochs():
    source = Counting(4)
    prefetcher = DevicePrefetcher(source, "cpu", depth=3)
    for epoch in range(3):
        iterator = iter(prefetcher)
        assert _values(iterator) == [0, 1, 2, 3]
        with pytest.raises(StopIteration):  # stays exhausted
            next(iterator)
        assert source.passes == epoch + 1


def test_prefetcher_over_an_empty_iterable_stops_at_once():
    assert list(DevicePrefetcher([], "cpu")) == []


def test_prefetcher_len_delegates():
    assert len(DevicePrefetcher(Counting(6), "cpu")) == 6
    with pytest.raises(TypeError):
        len(DevicePrefetcher(iter([1, 2]), "cpu"))


def test_prefetcher_passes_source_errors_through():
    def broken():
        yield torch.zeros(1)
        raise OSError("disk gone")

    iterator = iter(DevicePrefetcher(broken(), "cpu", depth=1))
    assert torch.equal(next(iterator), torch.zeros(1))  # the batch before the error first
    with pytest.raises(OSError, match="disk gone"):
        next(iterator)
    with pytest.raises(StopIteration):  # a generator that raised is finished
        next(iterator)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
def test_prefetcher_rejects_bad_depth_naming_it(bad, error):
    with pytest.raises(error, match="depth"):
        DevicePrefetcher([], "cpu", depth=bad)


def test_prefetcher_rejects_a_missing_device_and_a_bad_transform():
    with pytest.raises(ValueError, match="device"):
        DevicePrefetcher([], None)
    with pytest.raises(TypeError, match="transform"):
        DevicePrefetcher([], "cpu", transform="normalize")


# -- DevicePrefetcher on CUDA -----------------------------------------------------------------


def _image_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=generator),
            torch.randint(0, 1000, (8,), generator=generator),
        )
        for _ in range(n)
    ]


@pytest.mark.cuda
@needs_cuda
def test_cuda_prefetcher_batches_equal_the_host_batches():
    host = _image_batches(6)
    out = list(DevicePrefetcher(host, "cuda", depth=2))
    assert len(out) == 6
    for (images, labels), (dev_images, dev_labels) in zip(host, out, strict=False):
        assert dev_images.is_cuda and dev_labels.is_cuda
        assert torch.equal(dev_images.cpu(), images) and torch.equal(dev_labels.cpu(), labels)


@pytest.mark.cuda
@needs_cuda
def test_cuda_prefetcher_transform_matches_the_cpu_transform():
    normalize = Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    host = _image_batches(4, seed=1)
    out = list(DevicePrefetcher(host, "cuda", transform=normalize))
    for batch, (dev_images, dev_labels) in zip(host, out, strict=False):
        expected_images, expected_labels = normalize(batch)
        torch.testing.assert_close(dev_images.cpu(), expected_images)
        assert torch.equal(dev_labels.cpu(), expected_labels)


@pytest.mark.cuda
@needs_cuda
def test_pin_pins_every_cpu_tensor_and_keeps_structure():
    batch = {"x": torch.ones(4), "pair": Pair(torch.zeros(2), "label"), "s": "text"}
    pinned = pin(batch)
    assert pinned["x"].is_pinned() and pinned["pair"].image.is_pinned()
    assert type(pinned["pair"]) is Pair and pinned["pair"].label == "label"
    assert pinned["s"] == "text"
    already = torch.ones(2).pin_memory()
    assert pin(already) is already


@pytest.mark.cuda
@needs_cuda
def test_cuda_copy_overlaps_compute_on_the_default_stream():
    """Copies on the side stream run while the training stream computes."""
    device = torch.device("cuda", torch.cuda.current_device())
    host = [torch.full((32 * 1024 * 1024,), float(i)).pin_memory() for i in range(8)]  # 128 MB
    weight = torch.randn(4096, 4096, device=device)

    def elapsed(fn) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    copy_s = min(elapsed(lambda: host[0].to(device, non_blocking=True)) for _ in range(3))
    matmul_s = min(elapsed(lambda: weight @ weight) for _ in range(3))
    reps = max(1, round(copy_s / matmul_s))
    step_s = min(elapsed(lambda: [weight @ weight for _ in range(reps)]) for _ in range(3))
    serial_s = len(host) * (copy_s + step_s)

    def train() -> None:
        total = torch.zeros((), device=device)
        for batch in DevicePrefetcher(host, device, depth=2):
            for _ in range(reps):
                out = weight @ weight
            total += batch[0] + out[0, 0]
        assert float(total) == pytest.approx(sum(range(8)) + 8 * float(out[0, 0]), rel=1e-3)

    train()  # warm up
    overlapped_s = min(elapsed(train) for _ in range(3))
    assert overlapped_s < 0.9 * serial_s, (overlapped_s, serial_s, copy_s, step_s)


@pytest.mark.cuda
@needs_cuda
def test_cuda_memory_is_not_reused_while_the_consumer_still_reads_it():
    """A stress loop: slow consumer kernels read and modify each batch after it is dropped."""
    device = torch.device("cuda", torch.cuda.current_device())
    weight = torch.randn(2048, 2048, device=device)
    n = 300

    def host_batches():
        for i in range(n):  # fresh pageable tensors: the prefetcher pins them
            yield {"x": torch.full((256, 1024), float(i)), "i": i}

    sums = []
    for batch in DevicePrefetcher(host_batches(), device, depth=3):
        for _ in range(4):  # keep the consumer stream busy so frees run ahead of the GPU
            weight = torch.tanh(weight @ weight)
        x = batch["x"]
        x.add_(1.0)
        sums.append(x.sum())
        del batch, x
    expected = torch.tensor([(i + 1.0) * 256 * 1024 for i in range(n)])
    assert torch.equal(torch.stack(sums).cpu(), expected)


@pytest.mark.cuda
@needs_cuda
def test_cuda_prefetcher_restarts_across_epochs_with_plain_cuda():
    prefetcher = DevicePrefetcher(Counting(5), "cuda")
    for _ in range(2):
        out = list(prefetcher)
        assert [int(b[0]) for b in out] == list(range(5))
        assert all(b.is_cuda for b in out)


def test_prefetcher_raises_a_source_error_after_the_batches_before_it_and_then_goes_on():
    class Source:
        def __init__(self):
            self.next_value = 0

        def __iter__(self):
            return self

        def __next__(self):
            value, self.next_value = self.next_value, self.next_value + 1
            if value in (2, 3):
                raise ValueError(f"batch {value}")
            if value == 6:
                raise StopIteration
            return torch.tensor([value])

    events = []
    iterator = iter(DevicePrefetcher(Source(), "cpu", depth=3))
    while True:
        try:
            events.append(int(next(iterator)))
        except ValueError as error:
            events.append(str(error))
        except StopIteration:
            break
    assert events == [0, 1, "batch 2", "batch 3", 4, 5]
    with pytest.raises(StopIteration):  # the end stays the end
        next(iterator)


def test_prefetcher_raises_a_transform_error_in_its_place():
    def fails_on_two(batch):
        if int(batch) == 2:
            raise RuntimeError("transform failed on 2")
        return batch

    batches = [torch.tensor([value]) for value in range(5)]
    iterator = iter(DevicePrefetcher(batches, "cpu", depth=2, transform=fails_on_two))
    assert [int(next(iterator)), int(next(iterator))] == [0, 1]
    with pytest.raises(RuntimeError, match="transform failed on 2"):
        next(iterator)
    assert [int(batch) for batch in iterator] == [3, 4]
