"""Fixtures for checkpoint tests: a real S3 API (moto's server on loopback) behind a cuttable proxy."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
import uuid

import pytest

from ftrt.chaos.proxy import TcpProxy
from ftrt.store.etcd_server import free_port


@pytest.fixture(scope="session")
def moto_server():
    exe = shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server is not installed: pip install -e '.[test]' brings moto[server].")
    port = free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=0.5)
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("moto_server did not start within 30 s")
    yield port
    proc.kill()
    proc.wait()


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
