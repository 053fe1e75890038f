"""Signed manifests: with the job's checkpoint key, only checkpoints signed under it are restored
or verify, so a writer of the bucket who rewrites files and manifest alike is still refused."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from ftrt.checkpoint import Checkpointer
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.signing import CheckpointKey, load_key
from ftrt.checkpoint.storage import parse_url, step_dir
from ftrt.errors import CheckpointCorrupt, ConfigError
from tests.checkpoint.test_checkpointer import fresh_state, make_state, same_params
from tests.checkpoint.test_no_pickle import planted

KEY = CheckpointKey(b"k" * 32, "test key")


def forge(root, step: int, metadata: bytes, key: CheckpointKey | None = None) -> None:
    """What a writer of the bucket without the job's key can do: replace ``.metadata`` and rewrite
    the manifest so that every size and SHA-256 agrees (signed under ``key``, or not at all)."""
    folder = root / step_dir(step)
    (folder / ".metadata").write_bytes(metadata)
    body = json.loads((folder / "manifest.json").read_text())
    body["files"][".metadata"] = {"size": len(metadata), "sha256": hashlib.sha256(metadata).hexdigest()}
    body.pop("signature", None)
    m = mf.Manifest.from_json(json.dumps(body).encode(), "forged")
    (folder / "manifest.json").write_bytes((m.signed(key) if key else m).to_json())


def test_a_keyed_checkpoint_is_summed_with_sha256_signed_and_restored(tmp_path):
    root = tmp_path / "ck"
    src = make_state()
    with Checkpointer(str(root), key=KEY) as ck:
        ck.save(1, src).wait()
    m = mf.read_manifest(parse_url(str(root)), step_dir(1), KEY)
    assert m.checksum == "sha256" and m.signature.startswith("hmac-sha256:")
    assert all(len(e.sha256) == 64 and not e.crc32 for e in m.files.values())
    dst = fresh_state()
    with Checkpointer(str(root), key=KEY) as ck:
        assert ck.restore(dst) == 1
    assert same_params(src["model"], dst["model"])


@pytest.mark.parametrize("signer", [None, CheckpointKey(b"x" * 32, "another key")], ids=["unsigned", "wrong-key"])
def test_a_forged_checkpoint_is_refused_and_its_pickle_never_runs(tmp_path, signer):
    root, marker = tmp_path / "ck", tmp_path / "pwned"
    src = make_state()
    with Checkpointer(str(root), key=KEY) as ck:
        ck.save(1, src).wait()
        ck.save(2, src).wait()
    forge(root, 2, planted(marker), signer)
    dst = fresh_state()
    with Checkpointer(str(root), key=KEY) as ck:
        assert ck.restore(dst) == 1  # step 2 is not trusted; the newest signed one is restored
    assert not marker.exists() and same_params(src["model"], dst["model"])
    with pytest.raises(CheckpointCorrupt, match="not signed" if signer is None else "does not match"):
        mf.read_manifest(parse_url(str(root)), step_dir(2), KEY)


def test_ckpt_verify_refuses_what_the_key_did_not_sign(tmp_path):
    root = tmp_path / "ck"
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY.secret + b"\n")
    with Checkpointer(str(root), key=load_key(str(key_file))) as ck:
        ck.save(1, make_state()).wait()
    with Checkpointer(str(root)) as ck:  # a job without the key writes unsigned CRC-32 manifests
        ck.save(2, make_state()).wait()

    def ftrt(*args, env=None):
        return subprocess.run([sys.executable, "-m", "ftrt.cli.main", "ckpt", *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, **(env or {})})

    ok = ftrt("verify", str(root), "1", "--key-file", str(key_file))
    assert ok.returncode == 0 and "sha256 sums match, signature valid" in ok.stdout, ok.stderr
    bad = ftrt("verify", str(root), "2", env={"FTRT_CHECKPOINT_KEY": KEY.secret.decode()})
    assert bad.returncode != 0 and "is not signed" in bad.stderr and "Traceback" not in bad.stderr
    listed = ftrt("ls", str(root), "--key-file", str(key_file)).stdout
    assert "sha256 signed" in listed and "NOT COMMITTED" in listed
    assert ftrt("verify", str(root)).returncode == 0  # without a key, the newest (unsigned) one verifies


def test_keys_that_cannot_work_are_refused_naming_their_source(tmp_path):
    short = tmp_path / "short"
    short.write_text("too short\n")
    with pytest.raises(ConfigError, match=f"--checkpoint-key-file {short} has 9 bytes"):
        load_key(str(short))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_key(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="FTRT_CHECKPOINT_KEY has 3 bytes"):
        load_key(environ={"FTRT_CHECKPOINT_KEY": "abc"})
    assert load_key(environ={}) is None
    assert "k" * 16 not in repr(load_key(environ={"FTRT_CHECKPOINT_KEY": "k" * 16}))
    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--checkpoint-key-file",
                          str(tmp_path / "missing"), "--no-warm", "-m", "ftrt.grpo"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "--checkpoint-key-file" in res.stderr and "Traceback" not in res.stderr


def test_ckpt_reads_the_jobs_pointer_from_a_secured_etcd(tmp_path, etcd_secure, etcd_secure_access, job_id):
    import asyncio

    from ftrt.jobkeys import JobKeys
    from ftrt.store.etcd import EtcdStore

    root = tmp_path / "ck"
    with Checkpointer(str(root)) as ck:
        ck.save(1, make_state()).wait()
        ck.save(2, make_state()).wait()  # committed on storage, but the job never pointed at it

    async def point_at(step: int) -> None:
        store = EtcdStore(etcd_secure.url, access=etcd_secure_access)
        try:
            body = {"step": step, "round": 1, "url": str(root), "time": 0.0}
            await store.put(f"{JobKeys(job_id).ckpt}latest", json.dumps(body).encode())
        finally:
            await store.close()

    asyncio.run(point_at(1))
    a = etcd_secure_access
    flags = ["--etcd", etcd_secure.url, "--job-id", job_id, "--etcd-cacert", a.cacert, "--etcd-cert", a.cert,
             "--etcd-key", a.key, "--etcd-user", a.user]
    env = {**os.environ, "FTRT_ETCD_PASSWORD": a.password}
    run = (lambda *args: subprocess.run([sys.executable, "-m", "ftrt.cli.main", "ckpt", *args], capture_output=True,
                                        text=True, timeout=120, env=env))
    listed = run("ls", str(root), *flags)
    assert listed.returncode == 0, listed.stderr
    one, two = [x for x in listed.stdout.splitlines() if x.startswith("step")]
    assert "<- the job's latest" in one and "above the job's latest: not trusted" in two
    verified = run("verify", str(root), *flags)
    assert verified.returncode == 0 and verified.stdout.startswith("step 1:"), verified.stdout + verified.stderr
    bad = run("ls", str(root), *flags[:-2])  # no user: etcd refuses the client certificate's name
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "ftrt: error:" in bad.stderr
