"""Fixtures for checkpoint tests: a real S3 API (moto's server on loopback) behind a cuttable proxy."""

from __future__ import annotations

import uuid

import pytest

from ftrt.chaos.proxy import TcpProxy
from ftrt.chaos.s3server import MotoS3


@pytest.fixture(scope="session")
def moto_server():
    with MotoS3() as server:
        yield server.port


@pytest.fixture
def s3(moto_server):
    """A fresh bucket behind a proxy; yields (url_prefix, storage_options, proxy)."""
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{moto_server}", aws_access_key_id="test",
        aws_secret_access_key="test", region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    with TcpProxy("127.0.0.1", moto_server) as proxy:
        opts = {
            "key": "test", "secret": "test",
            "client_kwargs": {"endpoint_url": f"http://{proxy.endpoint}", "region_name": "us-east-1"},
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}},
            "skip_instance_cache": True,
        }
        yield f"s3://{bucket}/run", opts, proxy
