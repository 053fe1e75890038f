"""A real S3 API on loopback: moto's server as a subprocess, for tests, benchmarks and chaos runs.

:class:`MotoS3` starts ``moto_server`` on a free loopback port, waits until it answers, creates
buckets and gives the fsspec ``storage_options`` that reach it. Stopping and starting it again
(same port, empty state) is how the chaos suite injects a storage outage.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

from ftrt.errors import FtrtError
from ftrt.store.etcd_server import free_port


class MotoS3:
    """``moto_server`` on ``127.0.0.1:<port>``; use as a context manager or call start/stop."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "MotoS3":
        exe = shutil.which("moto_server")
        if exe is None:
            raise FtrtError("moto_server is not installed; pip install -e '.[test]' brings moto[server].")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FtrtError(f"moto_server exited with code {self.proc.returncode} while starting "
                                f"on port {self.port}.")
            try:
                urllib.request.urlopen(self.endpoint_url + "/", timeout=0.5)
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise FtrtError(f"moto_server did not answer on {self.endpoint_url} within {timeout:.0f} s.")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id="test",
                     aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket=name)

    def storage_options(self, endpoint_url: str | None = None) -> dict:
        """fsspec/s3fs options for this server (or for a proxy in front of it)."""
        return {"key": "test", "secret": "test",
                "client_kwargs": {"endpoint_url": endpoint_url or self.endpoint_url, "region_name": "us-east-1"}}

    def __enter__(self) -> "MotoS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
