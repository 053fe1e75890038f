"""One contract for every Store: the same tests run on the in-memory store and on real etcd."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from ftrt.errors import LeaseLost
from ftrt.store.api import Compare, Delete, Get, Put, Store
from ftrt.store.etcd import EtcdStore
from ftrt.store.memory import MemoryStore


@pytest.fixture(params=["memory", "etcd", "etcd-tls-auth"])
async def store(request) -> Store:
    if request.param == "memory":
        s: Store = MemoryStore()
    elif request.param == "etcd":
        s = EtcdStore(request.getfixturevalue("etcd_endpoint"), timeout=3.0)
    else:  # TLS with a client certificate, and a user whose token etcd lets expire after 1 s unused
        s = EtcdStore(request.getfixturevalue("etcd_secure").url, timeout=3.0,
                      access=request.getfixturevalue("etcd_secure_access"))
    yield s
    await s.close()


@pytest.fixture
def pfx() -> str:
    return f"/ftrt/contract-{uuid.uuid4().hex[:8]}/"  # under /ftrt/: the only prefix a job's etcd user may use


async def next_batch(it, timeout: float = 5.0):
    return await asyncio.wait_for(it.__anext__(), timeout)


async def collect(it, count: int, timeout: float = 5.0):
    events = []
    deadline = time.monotonic() + timeout
    while len(events) < count:
        events.extend(await asyncio.wait_for(it.__anext__(), max(0.01, deadline - time.monotonic())))
    return events


async def test_put_get_revisions(store, pfx):
    missing, rev0 = await store.get(pfx + "k")
    assert missing is None and rev0 > 0
    r1 = await store.put(pfx + "k", b"v1")
    r2 = await store.put(pfx + "k", b"v2")
    assert r2 > r1 > rev0 - 1
    kv, rev = await store.get(pfx + "k")
    assert kv.value == b"v2" and kv.create_revision == r1 and kv.mod_revision == r2
    assert kv.version == 2 and rev >= r2


async def test_prefix_get_is_sorted_and_scoped(store, pfx):
    for k in ("b", "a", "c/d"):
        await store.put(pfx + k, k.encode())
    await store.put(pfx[:-1] + "-other", b"x")
    kvs, _ = await store.get_prefix(pfx)
    assert [kv.key for kv in kvs] == [pfx + "a", pfx + "b", pfx + "c/d"]
    assert await store.delete(pfx + "a") is True
    assert await store.delete(pfx + "a") is False
    assert await store.delete_prefix(pfx) == 2
    assert (await store.get_prefix(pfx))[0] == []
    assert (await store.get(pfx[:-1] + "-other"))[0] is not None


async def test_last_created_finds_the_predecessor_by_create_revision(store, pfx):
    # Keys sort against creation order, and a later update does not move a key's creation.
    r_c = await store.put(pfx + "c", b"1")
    r_a = await store.put(pfx + "a", b"2")
    r_b = await store.put(pfx + "b", b"3")
    await store.put(pfx + "c", b"updated")
    await store.put(pfx[:-1] + "-other", b"x")
    assert (await store.last_created(pfx, r_b))[0].key == pfx + "b"
    assert (await store.last_created(pfx, r_b - 1))[0].key == pfx + "a"
    assert (await store.last_created(pfx, r_a - 1))[0].key == pfx + "c"
    got, rev = await store.last_created(pfx, r_c - 1)
    assert got is None and rev >= r_b
    assert (await store.last_created(pfx, 0))[0] is None
    await store.delete(pfx + "a")
    assert (await store.last_created(pfx, r_b - 1))[0].key == pfx + "c"


async def test_compare_and_swap(store, pfx):
    key = pfx + "round"
    ok = await store.txn([Compare.absent(key)], [Put(key, b"1")])
    assert ok.succeeded
    again = await store.txn([Compare.absent(key)], [Put(key, b"other")], [Get(key)])
    assert not again.succeeded and again.results[0][0].value == b"1"
    kv, _ = await store.get(key)
    stale = kv.mod_revision - 1
    assert not (await store.txn([Compare.mod_revision(key, stale)], [Put(key, b"2")])).succeeded
    res = await store.txn(
        [Compare.mod_revision(key, kv.mod_revision), Compare.value_is(key, b"1")],
        [Put(key, b"2"), Put(pfx + "side", b"s"), Get(pfx, prefix=True)],
    )
    assert res.succeeded
    assert [x.key for x in res.results[2]] == [key, pfx + "side"]
    both, _ = await store.get_prefix(pfx)
    assert {kv.mod_revision for kv in both} == {res.revision}  # one atomic revision
    assert (await store.txn([Compare.exists(key)], [Delete(pfx, prefix=True)])).succeeded
    assert (await store.get_prefix(pfx))[0] == []


async def test_lease_keys_die_with_revoke_and_unknown_lease_is_refused(store, pfx):
    lease = await store.grant_lease(5)
    assert lease.ttl >= 5
    await store.put(pfx + "a", b"1", lease=lease.id)
    kv, _ = await store.get(pfx + "a")
    assert kv.lease == lease.id
    assert await store.keep_alive(lease.id) >= 5
    await store.revoke_lease(lease.id)
    assert (await store.get(pfx + "a"))[0] is None
    with pytest.raises(LeaseLost):
        await store.keep_alive(lease.id)
    with pytest.raises(LeaseLost):
        await store.put(pfx + "b", b"1", lease=lease.id)
    with pytest.raises(LeaseLost):
        await store.txn([], [Put(pfx + "c", b"1", lease=lease.id)])
    await store.revoke_lease(lease.id)  # revoking again is fine


async def test_lease_expiry_deletes_keys_and_is_watched(store, pfx):
    _, rev = await store.get(pfx)
    lease = await store.grant_lease(1)
    await store.put(pfx + "node", b"x", lease=lease.id)
    it = store.watch_prefix(pfx, rev + 1)
    try:
        events = await collect(it, 2, timeout=6.0)
        assert [(e.kind, e.key) for e in events] == [("put", pfx + "node"), ("delete", pfx + "node")]
    finally:
        await it.aclose()
    assert (await store.get(pfx + "node"))[0] is None


async def test_watch_replays_history_from_a_revision_in_order(store, pfx):
    r1 = await store.put(pfx + "a", b"1")
    await store.put(pfx + "b", b"2")
    await store.delete(pfx + "a")
    it = store.watch_prefix(pfx, r1)
    try:
        events = await collect(it, 3)
        await store.put(pfx + "c", b"3")
        events += await collect(it, 1)
    finally:
        await it.aclose()
    assert [(e.kind, e.key[len(pfx):], e.value) for e in events] == [
        ("put", "a", b"1"), ("put", "b", b"2"), ("delete", "a", b""), ("put", "c", b"3"),
    ]
    revs = [e.revision for e in events]
    assert revs == sorted(revs) and len(set(revs)) == 4


async def test_watch_from_zero_means_from_now(store, pfx):
    await store.put(pfx + "old", b"1")
    it = store.watch_prefix(pfx, 0)
    try:
        task = asyncio.ensure_future(next_batch(it, timeout=30))
        # The watch starts at some moment after it is asked for: put until it has seen a put.
        n = 0
        while not task.done() and n < 300:
            n += 1
            await store.put(pfx + f"new-{n}", b"2")
            await asyncio.wait([task], timeout=0.1)
        batch = await task
    finally:
        await it.aclose()
    assert len(batch) == 1 and batch[0].key.startswith(pfx + "new-"), batch  # never the older put
