"""Errors that say what a file or folder is when it is not what the class reads: an image
folder given to a pack dataset, an LMDB pack given to HDF5Dataset, a missing file."""

from __future__ import annotations

import lmdb
import pytest
from _images import ImageDataset, make_image_folder

from fastloader import HDF5Dataset, LMDBDataset, PackError, pack
from fastloader.datasets.users_files import HDF5FileDataset


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hints")
    make_image_folder(root / "images")
    pack(ImageDataset(), root / "train.lmdb", workers=0)
    env = lmdb.open(str(root / "users.mdb"), subdir=False)
    with env.begin(write=True) as txn:
        txn.put(b"key", b"value")
    env.close()
    (root / "empty").mkdir()
    return root


@pytest.mark.parametrize(
    ("cls", "packed"), [(LMDBDataset, "images.lmdb"), (HDF5Dataset, "images.h5")]
)
def test_an_image_folder_given_to_a_pack_dataset_names_imagefolder_and_packing(files, cls, packed):
    folder = files / "images"
    with pytest.raises(PackError) as error:
        cls(folder)
    message = str(error.value)
    assert f"It looks like an image folder: read it with fastloader.ImageFolder('{folder}')" in (
        message
    )
    assert f"`fastloader-pack {folder} {packed}`" in message
    with pytest.raises(PackError) as error:
        cls(files / "empty")  # a folder of no images: no such hint
    assert "image folder" not in str(error.value)


def test_an_lmdb_pack_given_to_hdf5_says_what_it_is(files):
    with pytest.raises(PackError, match=r"train.lmdb: a fastloader LMDB pack, not an HDF5 file"):
        HDF5Dataset(files / "train.lmdb")
    with pytest.raises(PackError, match=r"users.mdb: an LMDB file, not an HDF5 file: read it "):
        HDF5Dataset(files / "users.mdb")
    assert len(LMDBDataset(files / "train.lmdb")) == len(ImageDataset())  # as the hint says


@pytest.mark.parametrize("cls", [HDF5Dataset, LMDBDataset, HDF5FileDataset])
def test_a_missing_file_is_no_such_file_not_a_missing_pack(files, cls):
    with pytest.raises(FileNotFoundError, match=r"missing.h5: no such file$"):
        cls(files / "missing.h5")
