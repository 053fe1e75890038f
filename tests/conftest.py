"""Shared fixtures: real etcd servers started from the binary ftrt installs, on free loopback ports."""

from __future__ import annotations

import os
import uuid

import pytest

from ftrt.store.etcd_server import EtcdCluster, EtcdServer


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory):
    """ftrt's per-user state (the credentials ``ftrt etcd`` leaves for its endpoints) in a folder of
    the session's, for the tests and every process they start: a test never reads or writes the
    user's own, and an etcd a test started closed on some port never speaks for a plaintext one
    another test starts on that port later in the user's real folder."""
    from ftrt import envnames

    before = os.environ.get(envnames.STATE_DIR)
    os.environ[envnames.STATE_DIR] = str(tmp_path_factory.mktemp("ftrt-state"))
    yield
    if before is None:
        os.environ.pop(envnames.STATE_DIR, None)
    else:
        os.environ[envnames.STATE_DIR] = before


@pytest.fixture(scope="session")
def etcd_server():
    """One etcd member for the whole session (1 s lease granularity, no fsync)."""
    server = EtcdServer(name="test-etcd", unsafe_no_fsync=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_endpoint(etcd_server) -> str:
    if not etcd_server.alive():  # a test may have killed it
        etcd_server.start()
    return etcd_server.endpoint


SECURE_USER, SECURE_PASSWORD = "job", "job-password"


@pytest.fixture(scope="session")
def etcd_secure(tmp_path_factory):
    """One etcd member with TLS, client certificates and auth on (user ``job`` may read and write
    ``/ftrt/``), its certificates made for the session. Tokens expire after 1 s unused, so a test
    that waits sees etcd refuse a stale one."""
    from ftrt.store.certs import tls_dir

    server = EtcdServer(name="secure-etcd", unsafe_no_fsync=True, tls=tls_dir(tmp_path_factory.mktemp("tls")),
                        extra_args=("--auth-token-ttl", "1"))
    server.start()
    server.enable_auth("root-password", {SECURE_USER: SECURE_PASSWORD})
    yield server
    server.stop()


@pytest.fixture
def etcd_secure_access(etcd_secure):
    """The credentials of user ``job`` on :func:`etcd_secure` (CA, client certificate, password)."""
    return etcd_secure.access(user=SECURE_USER, password=SECURE_PASSWORD)


@pytest.fixture
def own_etcd():
    """A private etcd member a test may kill or restart."""
    server = EtcdServer(name="own-etcd", unsafe_no_fsync=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_cluster():
    """A private 3-member etcd cluster on loopback."""
    cluster = EtcdCluster(3, unsafe_no_fsync=True)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def job_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def pytest_configure(config):
    # Worker processes started by tests must not inherit a user's distributed settings.
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
