"""``ftrt ckpt`` against storage it cannot use: one clear line naming the problem, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def ckpt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrt.cli.main", "ckpt", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def no_aws_credentials() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"}


def test_s3_storage_problems_are_one_line_each(s3):
    url, opts, proxy = s3
    anonymous = {k: v for k, v in opts.items() if k not in ("key", "secret")}
    res = ckpt("verify", url, "--storage-options", json.dumps(anonymous), env=no_aws_credentials())
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(
        f"ftrt: error: Cannot read the checkpoints at {url}: no S3 credentials were found. Set AWS_ACCESS_KEY_ID")

    proxy.cut()
    res = ckpt("verify", url, "--storage-options", json.dumps(opts))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "the storage could not be reached" in res.stderr and "Check the endpoint" in res.stderr, res.stderr
