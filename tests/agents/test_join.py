"""An agent's registration on real etcd: who may take a node id that is still registered.

The agent runs in-process here (no workers, no rendezvous): only its join step, against a real
etcd member, with a real listening socket standing in for a live agent's gRPC port.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from ftrt.agents.agent import Agent
from ftrt.agents.config import load_config
from ftrt.errors import LeaseLost, NodeIdConflict
from ftrt.store.etcd import EtcdStore


def _agent(store: EtcdStore, endpoint: str, job_id: str, script: str, addr: str) -> Agent:
    cfg = load_config(etcd=endpoint, job_id=job_id, node_id="n0", warm_workers=False, lease_ttl=10,
                      script=script)
    agent = Agent(cfg, store=store)
    agent.agent_addr = addr
    return agent


def test_rejoin_replaces_the_agents_own_earlier_registration(tmp_path, etcd_endpoint, job_id):
    script = tmp_path / "train.py"
    script.write_text("")
    # A live listener: a takeover may not pass as "the holder is dead" (its port refuses).
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"

    async def main() -> None:
        store = EtcdStore(etcd_endpoint)
        agent = _agent(store, etcd_endpoint, job_id, str(script), addr)
        other = _agent(store, etcd_endpoint, job_id, str(script), "127.0.0.2:1")  # same pid, other address
        try:
            await agent._join()
            first = agent.record
            # What fencing does when the agent believes its lease lost: stop renewing, keep the key.
            agent.session.orphan()
            # Another agent with the same node id is refused while the holder's port is live ...
            with pytest.raises(NodeIdConflict, match="already held"):
                await other._join()
            # ... but the holder itself replaces its earlier registration.
            await agent._join()
            second = agent.record
            assert second.incarnation != first.incarnation
            assert second.lease == agent.session.lease_id != first.lease
            kv, _ = await store.get(agent.keys.node("n0"))
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
