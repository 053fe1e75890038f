"""An agent's registration on real etcd: who may take a node id that is still registered.

Only the agent's membership runs here (no workers, no rendezvous): its join step, against a real
etcd member, with a real listening socket standing in for a live agent's gRPC port.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

import logging

from ftrt.agents.rendezvous.membership import Membership
from ftrt.errors import LeaseLost, NodeIdConflict
from ftrt.jobkeys import JobKeys
from ftrt.store.etcd import EtcdStore


def _agent(store: EtcdStore, job_id: str, addr: str) -> Membership:
    return Membership(store, JobKeys(job_id), node_id="n0", host="127.0.0.1", agent_addr=addr, nproc=1,
                      lease_ttl=10, on_renew=lambda _deadline: None, log=logging.getLogger("test"))


def test_rejoin_replaces_the_agents_own_earlier_registration(tmp_path, etcd_endpoint, job_id):
    # A live listener: a takeover may not pass as "the holder is dead" (its port refuses).
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"

    async def main() -> None:
        store = EtcdStore(etcd_endpoint)
        agent = _agent(store, job_id, addr)
        other = _agent(store, job_id, "127.0.0.2:1")  # same pid, other address
        try:
            await agent.join(ready=True)
            first = agent.record
            # What fencing does when the agent believes its lease lost: stop renewing, keep the key.
            agent.session.orphan()
            # Another agent with the same node id is refused while the holder's port is live ...
            with pytest.raises(NodeIdConflict, match="already held"):
                await other.join(ready=True)
            # ... but the holder itself replaces its earlier registration.
            await agent.join(ready=True)
            second = agent.record
            assert second.incarnation != first.incarnation
            assert second.lease == agent.session.lease_id != first.lease
            kv, _ = await store.get(JobKeys(job_id).node("n0"))
            assert kv is not None and kv.lease == second.lease
            with pytest.raises(LeaseLost):  # the earlier lease was revoked, not left to expire
                await store.keep_alive(first.lease)
        finally:
            if agent.session is not None:
                await agent.session.close()
            await store.close()

    try:
        asyncio.run(main())
    finally:
        listener.close()


def test_a_failed_join_leaves_no_lease_renewing(etcd_endpoint, job_id):
    """A join whose registration fails closes the lease it took (else it renewed forever, and a
    candidacy under it could hold an election slot for good)."""
    from ftrt.errors import StoreUnavailable

    class FailingRegistration(EtcdStore):
        granted: list[int] = []

        async def grant_lease(self, ttl, **kw):
            lease = await super().grant_lease(ttl, **kw)
            self.granted.append(lease.id)
            return lease

        async def txn(self, compare, success, failure=(), **kw):
            raise StoreUnavailable("etcd went away during the registration")

    async def main() -> None:
        store = FailingRegistration(etcd_endpoint)
        member = _agent(store, job_id, "127.0.0.1:1")
        try:
            with pytest.raises(StoreUnavailable):
                await member.join(ready=True)
            assert member.registration() is None and member.session is None
            assert len(store.granted) == 1
            with pytest.raises(LeaseLost):  # revoked, not left renewing
                await EtcdStore.keep_alive(store, store.granted[0])
        finally:
            await store.close()

    asyncio.run(main())
