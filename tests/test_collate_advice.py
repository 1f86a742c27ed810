"""A batch of PIL images cannot be collated: the error says where the images are in each sample
and gives the advice that applies to the dataset read (NOTE [ Advice that fits the dataset ])."""

from __future__ import annotations

import pytest
from _images import ImageDataset, make_image_folder
from torch.utils.data import Subset

from fastloader import DataLoader, ImageFolder, LMDBDataset, pack
from fastloader.datasets.collate import PILImagesError, default_collate
from fastloader.transforms import Compose, PILToTensor, Resize

WORKERS = pytest.mark.parametrize("workers", [0, 1])


def first_batch_error(dataset, workers: int) -> str:
    # closed here: an iterator kept alive by the error's traceback stops its worker whenever the
    # garbage collector meets it, which once fell inside a later compile (CPython 3.11 then
    # raised "AST constructor recursion depth mismatch" at the end of the session)
    with DataLoader(dataset, batch_size=4, num_workers=workers) as loader:
        with pytest.raises(PILImagesError) as error:
            next(iter(loader))
    return str(error.value)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return make_image_folder(tmp_path_factory.mktemp("folder"))


@WORKERS
def test_a_pack_read_as_pil_names_its_decode_values(tmp_path, workers):
    pack(ImageDataset(), tmp_path / "images.lmdb", workers=0)
    message = first_batch_error(LMDBDataset(tmp_path / "images.lmdb"), workers)
    assert "element 0 of each sample (a tuple) is a PIL.Image" in message
    assert "LMDBDataset(..., decode='numpy')" in message and "decode='tensor'" in message
    assert "ImageFolder" not in message and "__getitem__" not in message


@WORKERS
def test_an_image_folder_names_a_transform_not_decode(folder, workers):
    message = first_batch_error(ImageFolder(folder), workers)
    assert "element 0 of each sample (a tuple) is a PIL.Image" in message
    assert "fastloader.ImageFolder gives PIL images" in message
    assert "pass a transform ending in fastloader.transforms.PILToTensor()" in message
    assert "decode=" not in message  # ImageFolder has no decode=
    split = Subset(ImageFolder(folder), range(4))  # a split of it: the same advice
    assert "pass a transform ending in" in first_batch_error(split, workers)
    message = first_batch_error(ImageFolder(folder, transform=Resize(8)), workers)
    assert "this ImageFolder's transform returns PIL images: end it with" in message
    batch = next(iter(DataLoader(ImageFolder(folder, Compose([Resize((8, 8)), PILToTensor()])))))
    assert tuple(batch[0].shape) == (1, 3, 8, 8)  # what the advice says works


@WORKERS
def test_a_users_own_dataset_is_told_to_convert_in_getitem(workers):
    message = first_batch_error(ImageDataset("pil"), workers)
    assert "element 0 of each sample (a tuple) is a PIL.Image" in message
    assert "convert them in the dataset's __getitem__ or its transform" in message
    assert "decode=" not in message and "ImageFolder" not in message


def test_dict_samples_and_bare_images_are_named_as_they_are():
    image = ImageDataset("pil")[0][0]
    with pytest.raises(PILImagesError, match=r"field 'image' of each sample \(a dict\) is a"):
        default_collate([{"image": image, "label": 0}] * 2)
    with pytest.raises(PILImagesError, match=r"each sample is a PIL.Image; convert them in"):
        default_collate([image] * 2)
    with pytest.raises(TypeError, match=r"element 0 and 1 of each sample \(a list\) are"):
        default_collate([[image, image]] * 2)
