"""The etcd store under faults: server restart, leader loss in a 3-member cluster, no server."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from ftrt.errors import ConfigError, LeaseLost, StoreUnavailable
from ftrt.store.etcd import EtcdStore, parse_endpoints


async def test_watch_resumes_after_server_restart_without_losing_events(own_etcd):
    store = EtcdStore(own_etcd.endpoint, timeout=5.0)
    try:
        r1 = await store.put("/w/a", b"1")
        it = store.watch_prefix("/w/", r1)
        first = await asyncio.wait_for(it.__anext__(), 5)
        assert [e.key for e in first] == ["/w/a"]
        own_etcd.kill()
        own_etcd.start()  # same data directory: the history is still there
        # Writes made while the watch reconnects must all arrive, in order.
        for i in range(5):
            await store.put(f"/w/k{i}", str(i).encode())
        seen = []
        while len(seen) < 5:
            seen += [e.key for e in await asyncio.wait_for(it.__anext__(), 10)]
        assert seen == [f"/w/k{i}" for i in range(5)]
        await it.aclose()
    finally:
        await store.close()


async def test_lease_survives_a_quick_server_restart(own_etcd):
    store = EtcdStore(own_etcd.endpoint, timeout=5.0)
    try:
        lease = await store.grant_lease(5)
        await store.put("/l/node", b"x", lease=lease.id)
        own_etcd.kill()
        own_etcd.start()
        assert await store.keep_alive(lease.id) > 0
        assert (await store.get("/l/node"))[0] is not None
    finally:
        await store.close()


def _keepalive_streams(endpoint: str) -> int:
    """LeaseKeepAlive streams etcd has seen opened (its /metrics)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    return sum(int(float(line.rpartition(" ")[2])) for line in text.splitlines()
               if line.startswith("grpc_server_started_total{") and 'grpc_method="LeaseKeepAlive"' in line)


async def test_renewals_share_one_keep_alive_stream_which_is_reopened_after_a_restart(own_etcd):
    store = EtcdStore(own_etcd.endpoint, timeout=5.0)
    try:
        lease = await store.grant_lease(5)
        before = _keepalive_streams(own_etcd.endpoint)
        ttls = [await store.keep_alive(lease.id) for _ in range(20)]
        assert all(t > 0 for t in ttls)
        assert _keepalive_streams(own_etcd.endpoint) - before == 1
        own_etcd.kill()
        own_etcd.start()  # the open stream breaks; the next renewal opens a new one
        assert await store.keep_alive(lease.id) > 0
        for _ in range(5):
            await store.keep_alive(lease.id)
        assert _keepalive_streams(own_etcd.endpoint) == 1  # counters restart with the server
        await store.revoke_lease(lease.id)
        with pytest.raises(LeaseLost):
            await store.keep_alive(lease.id)
    finally:
        await store.close()


async def test_lease_renewals_go_on_through_a_leader_loss(etcd_cluster):
    """Keep-alive streams on the lost leader, or ended by the members that lost it, are reopened:
    a renewal after it succeeds within its deadline (it once raised InvalidStateError, writing to a
    stream the server had ended, and the agent's keep-alive task died without a word)."""
    stores = [EtcdStore(etcd_cluster.endpoints, timeout=3.0) for _ in range(3)]
    try:
        leases = [(await s.grant_lease(5)).id for s in stores]
        for s, lease in zip(stores, leases):
            assert await s.keep_alive(lease) > 0  # each store's stream is open now
        etcd_cluster.leader().kill()
        for _ in range(4):
            for s, lease in zip(stores, leases):
                assert await s.keep_alive(lease, timeout=3.0) > 0
            await asyncio.sleep(0.3)
    finally:
        for s in stores:
            await s.close()


async def test_leader_loss_in_a_cluster_is_a_short_pause(etcd_cluster):
    store = EtcdStore(etcd_cluster.endpoints, timeout=5.0, attempt_timeout=0.5)
    try:
        _, rev = await store.get("/c/")
        it = store.watch_prefix("/c/", rev + 1)
        leader = etcd_cluster.leader()
        gaps = []
        last = time.monotonic()
        for i in range(60):
            if i == 20:
                leader.kill()
            await store.put(f"/c/{i:03d}", b"x")
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        # Every write landed and the watch saw every one, in order, across the election.
        keys = []
        while len(keys) < 60:
            keys += [e.key for e in await asyncio.wait_for(it.__anext__(), 10)]
        assert keys == [f"/c/{i:03d}" for i in range(60)]
        # "A short pause": an election takes about 1 s with 500 ms election timeouts.
        assert max(gaps) < 4.0, f"longest pause {max(gaps):.2f} s"
        await it.aclose()
    finally:
        await store.close()


async def test_unreachable_etcd_fails_within_the_deadline_with_a_clear_message():
    store = EtcdStore("127.0.0.1:1", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        await store.get("/x")
    assert time.monotonic() - t0 < 3.0
    assert "127.0.0.1:1" in str(err.value) and "within 1.0 s" in str(err.value)
    await store.close()


@pytest.mark.parametrize("spec", ["", "host", "host:port", "a:99999", ":2379"])
def test_bad_endpoints_are_rejected_naming_the_value(spec):
    with pytest.raises(ConfigError):
        parse_endpoints(spec)


def test_endpoints_accept_lists_and_http_prefix():
    assert parse_endpoints("http://127.0.0.1:2379, localhost:2380") == [
        ("127.0.0.1", 2379), ("localhost", 2380)]
