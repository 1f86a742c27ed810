"""fastloader.transforms.Normalize: values, the batch-structure rule, errors."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from fastloader.transforms import Normalize

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

Batch = namedtuple("Batch", ["images", "labels"])


def _images(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _by_hand(images: torch.Tensor, mean=MEAN, std=STD) -> torch.Tensor:
    """(x / 255 - mean) / std, one value at a time in float64."""
    channels = images.shape[-3]
    mean = mean * channels if len(mean) == 1 else mean
    std = std * channels if len(std) == 1 else std
    flat = images.reshape(-1, channels, images.shape[-2] * images.shape[-1]).tolist()
    out = [
        [[(v / 255.0 - mean[c]) / std[c] for v in plane] for c, plane in enumerate(image)]
        for image in flat
    ]
    return torch.tensor(out, dtype=torch.float64).reshape(images.shape)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 4, 5)])
def test_normalize_matches_a_hand_computation(shape):
    images = _images(*shape)
    out = Normalize(MEAN, STD)(images)
    assert out.dtype == torch.float32 and out.shape == images.shape
    torch.testing.assert_close(out.double(), _by_hand(images), rtol=1e-6, atol=1e-5)


def test_normalize_extremes_map_to_the_expected_range():
    images = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2)
    out = Normalize([0.5], [0.5])(images)
    assert out.flatten().tolist() == pytest.approx([-1.0, 1.0])


def test_normalize_single_mean_and_std_apply_to_every_channel():
    images = _images(2, 3, 2, 2, seed=1)
    out = Normalize([0.5], [0.25])(images)
    torch.testing.assert_close(out.double(), _by_hand(images, (0.5,), (0.25,)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_normalize_output_dtype(dtype):
    images = _images(2, 3, 4, 4, seed=2)
    out = Normalize(MEAN, STD, dtype=dtype)(images)
    assert out.dtype == dtype
    tolerance = 1e-9 if dtype == torch.float64 else 5e-2
    torch.testing.assert_close(out.double(), _by_hand(images), atol=tolerance, rtol=tolerance)


def test_normalize_channels_last_for_4d_batches_only():
    normalize = Normalize(MEAN, STD, channels_last=True)
    batch = normalize(_images(2, 3, 4, 5))
    assert batch.is_contiguous(memory_format=torch.channels_last)
    assert not batch.is_contiguous()
    torch.testing.assert_close(batch, Normalize(MEAN, STD)(_images(2, 3, 4, 5)))
    single = normalize(_images(3, 4, 5))
    assert single.is_contiguous()


def test_normalize_applies_to_the_first_element_of_a_tuple_or_list_only():
    images, labels = _images(2, 3, 4, 4), torch.tensor([3, 7])
    normalize = Normalize(MEAN, STD)
    expected = normalize(images)

    out_tuple = normalize((images, labels, "meta"))
    assert type(out_tuple) is tuple and len(out_tuple) == 3
    torch.testing.assert_close(out_tuple[0], expected)
    assert out_tuple[1] is labels and out_tuple[2] == "meta"

    out_list = normalize([images, labels])
    assert type(out_list) is list and out_list[1] is labels
    torch.testing.assert_close(out_list[0], expected)

    out_named = normalize(Batch(images, labels))
    assert type(out_named) is Batch and out_named.labels is labels
    torch.testing.assert_close(out_named.images, expected)


def test_normalize_leaves_its_input_unchanged():
    images = _images(1, 3, 2, 2)
    before = images.clone()
    Normalize(MEAN, STD)(images)
    assert torch.equal(images, before)


def test_normalize_channel_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="3 mean/std values but the images have 1 channels"):
        Normalize(MEAN, STD)(_images(2, 1, 4, 4))


@pytest.mark.parametrize(
    "mean, std, match",
    [
        ((0.5, 0.5), (0.5,), "same length"),
        ((), (), "at least one"),
        ((0.5,), (0.0,), "zeros"),
    ],
)
def test_normalize_rejects_bad_mean_and_std(mean, std, match):
    with pytest.raises(ValueError, match=match):
        Normalize(mean, std)


def test_normalize_rejects_non_float_dtype():
    with pytest.raises(TypeError, match="dtype"):
        Normalize(MEAN, STD, dtype=torch.int32)


@pytest.mark.parametrize(
    "batch, error, match",
    [
        (torch.rand(2, 3, 4, 4), TypeError, "uint8"),
        (torch.zeros(3, 4, dtype=torch.uint8), ValueError, "shape"),
        ({"images": torch.zeros(3, 4, 4, dtype=torch.uint8)}, TypeError, "first element"),
        (("labels first", torch.zeros(3, 4, 4, dtype=torch.uint8)), TypeError, "uint8"),
    ],
    ids=["float-images", "2d", "dict", "images-not-first"],
)
def test_normalize_rejects_inputs_it_does_not_handle(batch, error, match):
    with pytest.raises(error, match=match):
        Normalize(MEAN, STD)(batch)


@pytest.mark.cuda
@needs_cuda
def test_normalize_on_cuda_matches_cpu():
    images = _images(4, 3, 16, 16, seed=3)
    normalize = Normalize(MEAN, STD, channels_last=True)
    out = normalize(images.cuda())
    assert out.is_cuda and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.cpu(), normalize(images))
