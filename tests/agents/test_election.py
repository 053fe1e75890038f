"""The decider election on a real etcd: one leader, and a leader's loss wakes only its successor."""

from __future__ import annotations

import asyncio
import urllib.request

from ftrt.agents.election import Election
from ftrt.jobkeys import JobKeys
from ftrt.store.api import Put
from ftrt.store.etcd import EtcdStore


def _requests(endpoint: str) -> int:
    """Unary KV requests etcd has handled (Range and Txn), from its /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    return sum(int(float(line.rpartition(" ")[2])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{") and 'grpc_type="unary"' in line
               and ('grpc_method="Range"' in line or 'grpc_method="Txn"' in line))


async def _settle() -> None:
    await asyncio.sleep(0.3)


async def test_candidates_lead_in_turn_and_a_leaders_loss_wakes_only_its_successor(own_etcd, job_id):
    keys = JobKeys(job_id)
    store = EtcdStore(own_etcd.endpoint, timeout=5.0)
    try:
        leases = [(await store.grant_lease(30)).id for _ in range(20)]
        elections = [Election(store, keys, lease, f"n{i}".encode()) for i, lease in enumerate(leases)]
        campaigns = []
        for e in elections:  # joined in order: the create revisions give the queue
            campaigns.append(asyncio.create_task(e.campaign()))
            await asyncio.sleep(0.01)
        await _settle()
        assert [c.done() for c in campaigns] == [True] + [False] * 19
        leader = elections[0]
        assert (await store.txn([leader.fence()], [Put(keys.decider, b"n0")])).succeeded

        before = _requests(own_etcd.endpoint)
        await store.revoke_lease(leases[0])  # the leader dies: its key goes with its lease
        await asyncio.wait_for(campaigns[1], 5)
        await _settle()
        # Its successor read its own predecessor once; nobody else woke (the old design: 19 races).
        assert _requests(own_etcd.endpoint) - before <= 2
        assert [c.done() for c in campaigns[2:]] == [False] * 18
        assert not (await store.txn([leader.fence()], [Put(keys.decider, b"n0")])).succeeded

        await store.revoke_lease(leases[3])  # a candidate in the middle leaves: nobody leads anew
        await _settle()
        assert [c.done() for c in campaigns[2:]] == [False] * 18
        await elections[1].resign()  # the leader steps down: the next one still waiting leads
        await asyncio.wait_for(campaigns[2], 5)
        await store.revoke_lease(leases[2])
        await asyncio.wait_for(campaigns[4], 5)  # 3 left earlier: its successor now waited on 2
        assert elections[4].leader and await elections[4].still_leads()
        assert [c.done() for c in campaigns[5:]] == [False] * 15
    finally:
        for c in campaigns:
            c.cancel()
        await store.close()
