"""fastloader.transforms: torchvision's image transforms (boxes, pixels, sizes); Normalize."""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
import pytest
import torch
from _images import smooth_rgb
from PIL import Image

from fastloader import transforms as T
from fastloader.vision.transforms import Normalize

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


# --- torchvision-named image transforms -----------------------------------------------------


def _torchvision_get_params(height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, written out: the draws we must repeat."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _photo(width=120, height=90, seed=0):
    return Image.fromarray(smooth_rgb(seed, width, height))


@pytest.mark.parametrize("size", [(90, 120), (500, 375), (3, 400), (400, 3)])
def test_random_resized_crop_draws_torchvisions_boxes(size):
    image = Image.new("RGB", (size[1], size[0]))
    for seed in range(50):
        torch.manual_seed(seed)
        ours = T.RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3))
        after_ours = torch.rand(1)
        torch.manual_seed(seed)
        assert ours == _torchvision_get_params(*size)
        assert torch.equal(after_ours, torch.rand(1)), "the same number of draws"


def test_random_resized_crop_boxes_respect_scale_and_ratio():
    torch.manual_seed(0)
    for _ in range(200):
        top, left, h, w = T.RandomResizedCrop.get_params(_photo(400, 300), (0.2, 0.5), (0.5, 2))
        assert 0 <= top <= 300 - h and 0 <= left <= 400 - w
        assert 0.2 * 0.9 <= h * w / (400 * 300) <= 0.5 * 1.1
        assert 0.5 * 0.9 <= w / h <= 2 * 1.1


def test_random_resized_crop_on_pil_is_pil_crop_then_bilinear_resize():
    image = _photo()
    torch.manual_seed(3)
    out = T.RandomResizedCrop((40, 50))(image)
    torch.manual_seed(3)
    top, left, h, w = _torchvision_get_params(90, 120)
    expected = image.crop((left, top, left + w, top + h)).resize((50, 40), Image.BILINEAR)
    assert out.size == (50, 40) and np.array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize(
    "transform",
    [
        T.Resize(50),
        T.Resize((30, 70)),
        T.CenterCrop(40),
        T.CenterCrop((80, 130)),  # larger than the image: zero-padded
        T.RandomResizedCrop(48),
        T.RandomHorizontalFlip(1.0),
    ],
    ids=repr,
)
def test_tensors_and_arrays_match_pil_within_rounding(transform):
    image = _photo()
    torch.manual_seed(0)
    from_pil = np.asarray(transform(image)).astype(int)
    torch.manual_seed(0)
    from_array = transform(np.asarray(image))
    torch.manual_seed(0)
    from_tensor = transform(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1))
    assert isinstance(from_array, np.ndarray) and from_array.dtype == np.uint8
    assert np.array_equal(from_array, from_pil)
    assert from_tensor.dtype == torch.uint8
    assert np.abs(from_tensor.permute(1, 2, 0).numpy().astype(int) - from_pil).max() <= 1


def test_resize_follows_torchvisions_size_rules():
    assert T.Resize(256).output_size(375, 500) == (256, 341)  # the longer side truncated
    assert T.Resize(256).output_size(500, 375) == (341, 256)
    assert T.Resize([256]).output_size(375, 500) == (256, 341)
    assert T.Resize((100, 200)).output_size(375, 500) == (100, 200)
    assert T.Resize(100, max_size=120).output_size(100, 300) == (40, 120)
    assert T.Resize(64)(_photo()).size == (85, 64)
    with pytest.raises(ValueError, match="max_size"):
        T.Resize((10, 20), max_size=30)
    with pytest.raises(ValueError, match="interpolation"):
        T.Resize(10, interpolation="lanczos-ish")
    with pytest.raises(ValueError, match="positive"):
        T.Resize(0)


def test_center_crop_rounds_as_torchvision_and_pads_with_zeros():
    assert T.CenterCrop(224).box(256, 341) == (16, 58, 224, 224)  # round(58.5) == 58
    assert T.CenterCrop(224).box(256, 343) == (16, 60, 224, 224)  # round(59.5) == 60
    padded = np.asarray(T.CenterCrop((94, 120))(_photo()))
    assert padded.shape == (94, 120, 3)
    assert not padded[:2].any() and not padded[-2:].any()
    assert np.array_equal(padded[2:-2], np.asarray(_photo()))


def test_flip_draws_one_number_and_flips_with_probability_p():
    image = np.asarray(_photo())
    assert np.array_equal(T.RandomHorizontalFlip(1.0)(image), image[:, ::-1])
    assert T.RandomHorizontalFlip(0.0)(image) is image
    flips = 0
    torch.manual_seed(0)
    for _ in range(400):
        flips += not np.array_equal(T.RandomHorizontalFlip()(image), image)
    assert 150 < flips < 250
    torch.manual_seed(1)
    T.RandomHorizontalFlip()(image)
    after = torch.rand(1)
    torch.manual_seed(1)
    torch.rand(1)
    assert torch.equal(after, torch.rand(1))


def test_pil_to_tensor_gives_uint8_chw_like_torchvision():
    image = _photo()
    tensor = T.PILToTensor()(image)
    assert tensor.dtype == torch.uint8 and tensor.shape == (3, 90, 120)
    assert np.array_equal(tensor.permute(1, 2, 0).numpy(), np.asarray(image))
    gray = T.PILToTensor()(image.convert("L"))
    assert gray.shape == (1, 90, 120)
    assert T.PILToTensor()(tensor) is tensor
    readonly = np.asarray(image)
    assert np.array_equal(T.PILToTensor()(readonly).permute(1, 2, 0).numpy(), readonly)
    with pytest.raises(TypeError, match="PILToTensor"):
        T.PILToTensor()("not an image")


def test_compose_mixes_user_callables_and_repeats_with_the_seed():
    seen = []
    pipeline = T.Compose(
        [
            T.RandomResizedCrop(32),
            lambda im: seen.append(im.size) or im,
            T.RandomHorizontalFlip(),
            T.PILToTensor(),
            lambda t: t.float() / 255,
        ]
    )
    torch.manual_seed(7)
    first = pipeline(_photo())
    torch.manual_seed(7)
    second = pipeline(_photo())
    assert torch.equal(first, second) and first.dtype == torch.float32
    assert seen == [(32, 32), (32, 32)]
    assert "RandomResizedCrop" in repr(pipeline)
