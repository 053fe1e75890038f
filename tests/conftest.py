"""Shared fixtures: real etcd servers started from the binary ftrt installs, on free loopback ports."""

from __future__ import annotations

import os
import uuid

import pytest

from ftrt.store.etcd_server import EtcdCluster, EtcdServer


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
