"""Shared pytest configuration: the `cuda` marker skips without a CUDA device; `s3`, the real
S3-compatible server (tests/_seaweed.py) with the bucket `S3_BUCKET`, one per session."""

import os

import pytest
import torch

S3_BUCKET = "fastloader-tests"


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    import boto3

    from tests import _seaweed

    server = _seaweed.start(tmp_path_factory.mktemp("seaweed"))
    saved = {name: os.environ.get(name) for name in server.env()}
    os.environ.update(server.env())
    try:
        boto3.client("s3").create_bucket(Bucket=S3_BUCKET)
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _seaweed.stop(server)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
