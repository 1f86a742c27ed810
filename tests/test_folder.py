"""fastloader.ImageFolder: torchvision's classes, order and errors; compact indexes; pickling."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from _images import EXPECTED_CLASSES, EXPECTED_ORDER, make_folder_with_bad_files, make_image_folder
from PIL import Image

from fastloader import DataLoader, ImageFolder, LMDBDataset, pack
from fastloader import transforms as T


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images") / "src")


def test_classes_samples_and_targets_follow_torchvisions_order(tree):
    dataset = ImageFolder(tree)
    assert dataset.classes == EXPECTED_CLASSES
    assert dataset.class_to_idx == {name: index for index, name in enumerate(EXPECTED_CLASSES)}
    expected = [(os.path.join(str(tree), path), label) for path, label in EXPECTED_ORDER]
    assert dataset.samples == expected and dataset.imgs == expected
    assert list(dataset.targets) == [label for _, label in EXPECTED_ORDER]
    assert len(dataset) == len(EXPECTED_ORDER)


def test_images_are_rgb_as_a_pack_of_the_same_folder_gives_them(tree, tmp_path):
    dataset = ImageFolder(tree)
    pack(tree, tmp_path / "p.lmdb", workers=1)
    packed = LMDBDataset(tmp_path / "p.lmdb")
    for index in range(len(dataset)):
        image, label = dataset[index]
        assert image.mode == "RGB" and label == packed[index][1]
        assert np.array_equal(np.asarray(image), np.asarray(packed[index][0]))


def test_indexes_are_arrays_not_lists_of_python_objects(tree):
    dataset = ImageFolder(tree)
    assert isinstance(dataset.targets, np.ndarray) and dataset.targets.dtype == np.int64
    per_sample = [
        name
        for name, value in vars(dataset).items()
        if isinstance(value, (list, tuple, dict)) and len(value) == len(dataset)
    ]
    assert per_sample == []


def test_transforms_target_transform_and_negative_indices(tree):
    transform = T.Compose([T.Resize(16), T.CenterCrop(12), T.PILToTensor()])
    dataset = ImageFolder(tree, transform=transform, target_transform=lambda y: y * 10)
    image, label = dataset[-1]
    assert image.shape == (3, 12, 12) and label == EXPECTED_ORDER[-1][1] * 10
    with pytest.raises(IndexError, match="out of range"):
        dataset[len(dataset)]


def test_custom_loader_and_is_valid_file(tree):
    loaded = []

    def loader(path: str) -> Image.Image:
        loaded.append(path)
        return Image.new("RGB", (4, 3))

    only_png = ImageFolder(
        tree, loader=loader, is_valid_file=lambda p: p.endswith(".png"), allow_empty=True
    )
    assert all(path.endswith(".png") for path, _ in only_png.samples)
    assert only_png[0][0].size == (4, 3) and loaded == [only_png.samples[0][0]]
    with pytest.raises(FileNotFoundError, match="no valid file"):
        ImageFolder(tree, is_valid_file=lambda p: p.endswith(".png"))


def test_missing_classes_and_bad_files_raise_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="class folder"):
        ImageFolder(tmp_path / "empty")
    bad = ImageFolder(make_folder_with_bad_files(tmp_path / "bad"))
    failures = []
    for index in range(len(bad)):
        try:
            bad[index]
        except OSError as error:
            assert bad.path(index) in str(error)
            failures.append(os.path.basename(bad.path(index)))
    assert sorted(failures) == ["empty.png", "text.jpg", "truncated.jpg"]


def test_pickles_and_loads_in_workers_like_torchvisions(tree):
    transform = T.Compose([T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.PILToTensor()])
    dataset = pickle.loads(pickle.dumps(ImageFolder(tree, transform)))
    loader = DataLoader(dataset, batch_size=4, num_workers=2, seed=1)
    images = torch.cat([batch for batch, _ in loader])
    loader.close()
    assert images.shape == (len(dataset), 3, 8, 8) and images.dtype == torch.uint8
    again = torch.cat([batch for batch, _ in DataLoader(dataset, batch_size=5, seed=1)])
    assert torch.equal(images, again)
