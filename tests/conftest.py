"""Shared pytest configuration: the `cuda` marker skips without a CUDA device; `s3`, the real
S3-compatible server (tests/_seaweed.py) with the bucket `S3_BUCKET`, one per session."""

import os
from unittest.mock import patch

import pytest
import torch

S3_BUCKET = "fastloader-tests"


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    import boto3

    from tests import _seaweed

    server = _seaweed.start(tmp_path_factory.mktemp("seaweed"))
    try:
        with patch.dict(os.environ, server.env()):
            boto3.client("s3").create_bucket(Bucket=S3_BUCKET)
            yield server
    finally:
        _seaweed.stop(server)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
