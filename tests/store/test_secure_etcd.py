"""etcd over TLS with client certificates and auth: what works, and each way it can be misconfigured.

The server is real etcd with certificates made in the test session (:func:`etcd_secure`); the
contract suite (test_contract.py) runs on it too. Each misconfiguration must end in one clear
error naming the flag or the user, at once rather than after retrying until a deadline.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from ftrt.errors import ConfigError, StoreError, StoreUnavailable
from ftrt.store.access import EtcdAccess, from_env
from ftrt.store.certs import tls_dir
from ftrt.store.etcd import EtcdStore


async def put_get(endpoints: str, access: EtcdAccess, timeout: float = 3.0) -> bytes:
    store = EtcdStore(endpoints, timeout=timeout, access=access)
    try:
        await store.put("/ftrt/secure-test/k", b"v")
        kv, _ = await store.get("/ftrt/secure-test/k")
        return kv.value
    finally:
        await store.close()


async def test_a_user_over_tls_reads_and_writes_and_outlives_its_token(etcd_secure, etcd_secure_access):
    store = EtcdStore(etcd_secure.url, timeout=3.0, access=etcd_secure_access)
    try:
        await store.put("/ftrt/secure-test/a", b"1")
        first = store._token
        lease = await store.grant_lease(5)
        await asyncio.sleep(2.5)  # the server's token TTL is 1 s: the token expires unused
        await store.put("/ftrt/secure-test/a", b"2", lease=lease.id)
        assert await store.keep_alive(lease.id) > 0
        assert (await store.get("/ftrt/secure-test/a"))[0].value == b"2"
        assert store._token and store._token != first  # authenticated again, transparently
    finally:
        await store.close()


async def test_a_watch_created_with_an_expired_token_authenticates_again(etcd_secure, etcd_secure_access):
    store = EtcdStore(etcd_secure.url, timeout=3.0, access=etcd_secure_access)
    try:
        rev = await store.put("/ftrt/secure-test/w/a", b"1")
        stale = store._token
        await asyncio.sleep(2.5)  # the token expires unused; the watch is created with it
        it = store.watch_prefix("/ftrt/secure-test/w/", rev + 1)
        pending = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.5)
        await store.put("/ftrt/secure-test/w/b", b"2")
        batch = await asyncio.wait_for(pending, 5.0)
        assert [(e.key, e.value) for e in batch] == [("/ftrt/secure-test/w/b", b"2")]
        assert store._token != stale
        await it.aclose()
    finally:
        await store.close()


async def test_a_user_cannot_leave_its_prefix(etcd_secure, etcd_secure_access):
    store = EtcdStore(etcd_secure.url, timeout=3.0, access=etcd_secure_access)
    try:
        with pytest.raises(StoreError, match="user 'job'.*permission denied.*/ftrt/"):
            await store.put("/elsewhere/k", b"v")
    finally:
        await store.close()


def test_misconfigurations_each_fail_at_once_naming_the_cause(etcd_secure, tmp_path):
    good = etcd_secure.access(user="job", password="job-password")
    other = tls_dir(tmp_path / "other-ca")
    cases = [
        (EtcdAccess(cacert=str(other.ca), cert=good.cert, key=good.key, user="job", password="job-password"),
         ConfigError, f"TLS handshake.*--etcd-cacert {other.ca}"),
        (EtcdAccess(cacert=good.cacert, user="job", password="job-password"),
         ConfigError, "TLS handshake.*client certificate"),
        (EtcdAccess(cacert=good.cacert, cert=str(other.client_cert()), key=str(other.client_key()),
                    user="job", password="job-password"), ConfigError, "TLS handshake"),
        (EtcdAccess(cacert=good.cacert, cert=good.cert, key=good.key, user="job", password="wrong"),
         ConfigError, "refused user 'job'.*FTRT_ETCD_PASSWORD or --etcd-password-file"),
        (EtcdAccess(cacert=good.cacert, cert=good.cert, key=good.key),
         StoreError, "without --etcd-user.*common name"),  # the certificate's name "ftrt" is no etcd user
    ]
    for access, error, message in cases:
        t0 = time.monotonic()
        with pytest.raises(error, match=message):
            asyncio.run(put_get(etcd_secure.url, access, timeout=5.0))
        assert time.monotonic() - t0 < 2.0, (access, "a wrong setting must not be retried until the deadline")
    with pytest.raises(StoreUnavailable, match="write https:// endpoints"):  # plaintext to a TLS port
        asyncio.run(put_get(etcd_secure.endpoint, EtcdAccess(), timeout=1.0))
    assert asyncio.run(put_get(etcd_secure.url, good)) == b"v"


def test_access_files_are_checked_before_any_call(etcd_secure, tmp_path):
    good = etcd_secure.access(user="job", password="x")
    other = tls_dir(tmp_path / "other")
    (tmp_path / "empty.pem").write_text("")
    cases = [
        (EtcdAccess(cacert=str(tmp_path / "missing.pem")), f"--etcd-cacert {tmp_path / 'missing.pem'} does not exist"),
        (EtcdAccess(cacert=str(tmp_path / "empty.pem")), "holds no usable PEM CA certificate"),
        (EtcdAccess(cacert=good.cacert, cert=good.cert), "--etcd-cert was given without --etcd-key"),
        (EtcdAccess(cacert=good.cacert, cert=good.cert, key=str(other.client_key())),
         "are not a PEM certificate and its matching private key"),
        (EtcdAccess(user="job"), "--etcd-user 'job' has no password"),
        (EtcdAccess(password_file=str(tmp_path / "empty.pem")), "without --etcd-user"),
        (EtcdAccess(user="job", password_file=str(tmp_path)), "is a directory"),
    ]
    for access, message in cases:
        with pytest.raises(ConfigError, match=message):
            access.check()
    good.check()


def test_a_worker_gets_paths_and_never_the_password(etcd_secure, tmp_path):
    from ftrt.records import Member, RoundRecord
    from ftrt.agents.workers.env import worker_env

    secret = tmp_path / "pw"
    secret.write_text("job-password\n")
    access = etcd_secure.access(user="job", password_file=str(secret))
    rnd = RoundRecord(round=3, members=(Member("n0", "inc", 1),))
    env = worker_env(rnd, node_id="n0", local_rank=0, job_id="j", master_addr="127.0.0.1", master_port=1,
                     max_restarts=0, agent_addr="127.0.0.1:1", etcd=etcd_secure.url, etcd_access=access)
    assert "job-password" not in "".join(env.values())
    got = from_env(env)
    assert (got.cacert, got.cert, got.key, got.user, got.secret()) == (access.cacert, access.cert, access.key,
                                                                      "job", "job-password")
    assert asyncio.run(put_get(env["FTRT_ETCD"], got)) == b"v"


def _ftrt(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrt.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_cli_errors_are_one_line_without_a_traceback(etcd_secure, tmp_path):
    good = etcd_secure.access()
    other = tls_dir(tmp_path / "other")
    base = ["status", "--etcd", etcd_secure.url, "--job-id", "nojob"]
    runs = [
        (_ftrt(*base, "--etcd-cacert", str(other.ca), "--etcd-cert", good.cert, "--etcd-key", good.key,
               "--etcd-user", "job", env={"FTRT_ETCD_PASSWORD": "job-password"}), f"--etcd-cacert {other.ca}"),
        (_ftrt(*base, "--etcd-cacert", good.cacert, "--etcd-cert", good.cert), "without --etcd-key"),
        (_ftrt(*base, "--etcd-cacert", good.cacert, "--etcd-cert", good.cert, "--etcd-key", good.key,
               "--etcd-user", "job", env={"FTRT_ETCD_PASSWORD": "nope"}), "refused user 'job'"),
        (_ftrt("launch", "--etcd", etcd_secure.url, "--etcd-user", "job", "--no-warm", "x.py",
               env={"FTRT_ETCD_PASSWORD": ""}), "has no password"),
    ]
    for res, message in runs:
        assert res.returncode != 0
        lines = [x for x in res.stderr.splitlines() if x.startswith("ftrt: error:")]
        assert len(lines) == 1 and message in lines[0], res.stderr[-2000:]
        assert "Traceback" not in res.stderr
    ok = _ftrt(*base, "--etcd-cacert", good.cacert, "--etcd-cert", good.cert, "--etcd-key", good.key,
               "--etcd-user", "job", env={"FTRT_ETCD_PASSWORD": "job-password"})
    assert "No job 'nojob' in etcd" in ok.stderr, ok.stderr[-2000:]  # etcd answered: the job is unknown


def test_ftrt_etcd_tls_makes_certificates_and_serves_a_user(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ftrt.cli.main", "etcd", "--tls", str(tmp_path / "tls"),
                             "--port", "0", "--auth-user", "alice"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "FTRT_ETCD_PASSWORD": "alice-pw"})
    try:
        first = proc.stdout.readline()
        assert first.startswith("etcd is serving on https://127.0.0.1:"), first + proc.stderr.read()
        url = first.split()[4]
        flags = proc.stdout.readline()
        assert "--etcd-cacert" in flags and "--etcd-user alice" in flags
        files = tls_dir(tmp_path / "tls")  # reuses what the command made
        assert oct((tmp_path / "tls" / "client-ftrt-key.pem").stat().st_mode & 0o777) == "0o600"
        access = EtcdAccess(cacert=str(files.ca), cert=str(files.client_cert()), key=str(files.client_key()),
                            user="alice", password="alice-pw")
        assert asyncio.run(put_get(url, access)) == b"v"
        with pytest.raises(ConfigError, match="refused user 'alice'"):
            asyncio.run(put_get(url, EtcdAccess(cacert=access.cacert, cert=access.cert, key=access.key,
                                                user="alice", password="bad")))
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
