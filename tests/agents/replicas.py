"""Helpers for tests of replication over real gRPC: a node registered under a lease in a store,
whose claims its replicator writes, and an agent service that checks replicas against them."""

from __future__ import annotations

import contextlib
import types
from pathlib import Path
from typing import AsyncIterator

import grpc.aio

from ftrt.agents.peers.claims import ClaimBook, ReplicaGate
from ftrt.agents.peers.replicator import Replicator
from ftrt.agents.peers.service import AgentServicer
from ftrt.auth import JobToken
from ftrt.jobkeys import JobKeys
from ftrt.store.api import Store
from ftrt.store.memory import MemoryStore
from ftrt.v1 import agent_pb2_grpc

KEYS = JobKeys("replication")


async def registered(store: Store, node_id: str, host: str = "127.0.0.1", keys: JobKeys = KEYS) -> ClaimBook:
    """Node ``node_id`` registered under a lease of its own (as an agent's membership does), and
    the claim book its replicator writes with."""
    lease = await store.grant_lease(60)
    await store.put(keys.node(node_id), b"{}", lease=lease.id)
    return ClaimBook(store, keys, node_id, host, lambda: (lease.id, "incarnation-1"))


async def replica_server(mem_dir: str, store: Store, token: JobToken,
                         keys: JobKeys = KEYS) -> tuple[grpc.aio.Server, int, AgentServicer]:
    """A started plaintext gRPC server storing replicas into ``mem_dir`` (a node's agent service
    with no status to tell); returns it, its port and its servicer (``.gate.refused``)."""
    server = grpc.aio.server()
    servicer = AgentServicer(types.SimpleNamespace(status=None), mem_dir, token, ReplicaGate(store, keys))
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, servicer


@contextlib.asynccontextmanager
async def replicating(src: Path, dst: Path, token: JobToken,
                      interval: float = 0.0) -> AsyncIterator[tuple[Replicator, int, AgentServicer]]:
    """Node ``a`` (memory directory ``src``, registered in a fresh in-memory store) replicating to
    a peer's service storing into ``dst``; yields a's replicator, the peer's port and its servicer."""
    store = MemoryStore()
    server, port, servicer = await replica_server(str(dst), store, token)
    rep = Replicator("a", str(src), token, await registered(store, "a"), interval=interval)
    rep.set_peers([f"127.0.0.1:{port}"])
    try:
        yield rep, port, servicer
    finally:
        await rep.close()
        await server.stop(None)
