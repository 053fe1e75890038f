"""The rendezvous follows its agent's registration: a node that registers after the rendezvous
started (a rejoin after a lost lease) becomes a candidate though nothing under ``rdzv/`` changed."""

from __future__ import annotations

import asyncio

from ftrt.agents.rendezvous.decide import RendezvousConfig
from ftrt.chaos.local import until
from ftrt.agents.rendezvous.rendezvous import Rendezvous
from ftrt.jobkeys import JobKeys
from ftrt.store.etcd import EtcdStore


async def test_a_registration_that_comes_later_still_makes_a_candidate(etcd_endpoint, job_id):
    store = EtcdStore(etcd_endpoint)
    registration: list[tuple[int, str]] = []
    rdzv = Rendezvous(store, JobKeys(job_id), "n0", RendezvousConfig(min_nodes=1, max_nodes=1),
                      registration=lambda: registration[0] if registration else None)
    await rdzv.start()
    try:
        await asyncio.sleep(0.3)
        assert not rdzv.deciding
        lease = await store.grant_lease(10)
        registration.append((lease.id, "inc-1"))  # registered: no key under rdzv/ moves
        await until(lambda: rdzv.deciding, 20, "the rendezvous to campaign and decide")
    finally:
        await rdzv.close()
        await store.close()
