"""The decider election on a real etcd: one leader among slot holders, a leader's loss wakes its
successor (and the agents waiting for its slot), and no more than SLOTS agents are candidates. Its
rules alone, on the in-memory store with an injected clock: tests/store/test_concurrency.py."""

from __future__ import annotations

import asyncio
import urllib.request

from ftrt.store.concurrency import SLOTS, Election, slot_of
from ftrt.jobkeys import JobKeys
from ftrt.store.api import Put
from ftrt.store.etcd import EtcdStore
from ftrt.chaos.local import until
from tests.store.test_concurrency import distinct_slots


def _requests(endpoint: str) -> int:
    """Unary KV requests etcd has handled (Range and Txn), from its /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    return sum(int(float(line.rpartition(" ")[2])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{") and 'grpc_type="unary"' in line
               and ('grpc_method="Range"' in line or 'grpc_method="Txn"' in line))


async def _settle() -> None:
    """Time for a wrongly woken candidate to show itself (only negative checks follow it)."""
    await asyncio.sleep(0.3)


async def test_slot_holders_lead_in_turn_and_a_leaders_loss_wakes_only_its_successor(own_etcd, job_id):
    keys = JobKeys(job_id)
    store = EtcdStore(own_etcd.endpoint, timeout=5.0)
    campaigns: list[asyncio.Task] = []
    try:
        ids = distinct_slots(8)
        leases = [(await store.grant_lease(30)).id for _ in ids]
        elections = [Election(store, keys.election, nid, lease, nid.encode()) for nid, lease in zip(ids, leases)]
        for e in elections:  # joined in order: the slot keys' create revisions give the queue
            campaigns.append(asyncio.create_task(e.campaign()))
            await until(lambda: e.create_revision, 10, f"{e.key} taken")
        await until(lambda: campaigns[0].done(), 10, "the first candidate to lead")
        await _settle()
        assert [c.done() for c in campaigns] == [True] + [False] * 7
        leader = elections[0]
        assert (await store.txn([leader.fence()], [Put(keys.decider, b"n0")])).succeeded

        before = _requests(own_etcd.endpoint)
        await store.revoke_lease(leases[0])  # the leader dies: its key goes with its lease
        await asyncio.wait_for(campaigns[1], 5)
        await _settle()
        # Its successor read its own predecessor once; nobody else woke.
        assert _requests(own_etcd.endpoint) - before <= 2
        assert [c.done() for c in campaigns[2:]] == [False] * 6
        assert not (await store.txn([leader.fence()], [Put(keys.decider, b"n0")])).succeeded

        await store.revoke_lease(leases[3])  # a candidate in the middle leaves: nobody leads anew
        await _settle()
        assert [c.done() for c in campaigns[2:]] == [False] * 6
        await elections[1].resign()  # the leader steps down: the next one still waiting leads
        await asyncio.wait_for(campaigns[2], 5)
        await store.revoke_lease(leases[2])
        await asyncio.wait_for(campaigns[4], 5)  # 3 left earlier: its successor now waited on 2
        assert elections[4].leader and await elections[4].still_leads()
        assert [c.done() for c in campaigns[5:]] == [False] * 3
    finally:
        for c in campaigns:
            c.cancel()
        await store.close()


async def test_at_most_slots_candidates_and_a_freed_slot_is_taken_by_one_waiting_agent(own_etcd, job_id):
    keys = JobKeys(job_id)
    store = EtcdStore(own_etcd.endpoint, timeout=5.0)
    campaigns: list[asyncio.Task] = []
    try:
        ids = [f"node-{i}" for i in range(3 * SLOTS)]
        leases = [(await store.grant_lease(30)).id for _ in ids]
        elections = [Election(store, keys.election, nid, lease, nid.encode()) for nid, lease in zip(ids, leases)]
        for e in elections:
            campaigns.append(asyncio.create_task(e.campaign()))
        slots = len({slot_of(i) for i in ids})
        await until(lambda: sum(bool(e.create_revision) for e in elections) == slots, 20, "every slot taken")
        await until(lambda: any(c.done() for c in campaigns), 10, "a leader")
        await _settle()
        kvs, _ = await store.get_prefix(keys.election)
        assert len(kvs) == slots <= SLOTS
        assert sum(c.done() for c in campaigns) == 1
        leader = next(e for e, c in zip(elections, campaigns) if c.done())
        sharing = [e for e in elections if e.key == leader.key and e is not leader]
        assert sharing and all(not e.create_revision for e in sharing)  # waiting for the slot
        await store.revoke_lease(leader.lease_id)
        await until(lambda: sum(c.done() for c in campaigns) == 2, 10, "someone to lead again")
        await until(lambda: any(e.create_revision for e in sharing), 10, "the freed slot taken")
        await _settle()
        assert sum(bool(e.create_revision) for e in sharing) == 1  # one of them holds the slot now
        assert sum(c.done() for c in campaigns) == 2  # and someone leads again
    finally:
        for c in campaigns:
            c.cancel()
        await store.close()
