"""Fast detection of dead peer agents, without waiting for their leases to run out.

Each agent keeps a liveness stream (:meth:`AgentService.Liveness`) open to its next two
successors in the round's member order, so every member is watched by two others and the cost
grows linearly with the job. When a stream breaks, the watcher tries a plain TCP connect to the
peer's agent port: an active refusal means the process is gone (the kernel answers for a dead
process), and ``on_dead`` is called, which revokes the peer's lease. A peer that is merely slow
or unreachable is left to its lease: a frozen node is detected within the lease TTL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc
import grpc.aio

from ftrt.agents.rendezvous.membership import tcp_refused
from ftrt.agents.peers.tls import PLAINTEXT, PeerChannels
from ftrt.auth import JobToken
from ftrt.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)


MONITORED_PEERS = 2
"""Each agent watches the liveness of this many ring successors (so a node's loss is seen by two
peers, and still by one when its predecessor is lost with it)."""


class PeerMonitor:
    """Holds liveness streams to a changing set of peers."""

    def __init__(
        self,
        node_id: str,
        token: JobToken,
        on_dead: Callable[[str, str], Awaitable[None]],
        interval: float = 0.5,
        channels: PeerChannels | None = None,
    ) -> None:
        self.node_id = node_id
        self.token = token
        """The job's token: a peer's agent answers ``Liveness`` only to the job's own agents."""
        self.channels = channels if channels is not None else PeerChannels(PLAINTEXT)
        """Where the streams' channels come from (shared with replication, kept across rounds)."""
        self.on_dead = on_dead
        self.interval = interval
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}

    def watch(self, peers: dict[str, str]) -> None:
        """Monitor exactly ``peers`` (node id -> agent address) from now on."""
        wanted = set(peers.items())
        for key in list(self._tasks):
            if key not in wanted:
                self._tasks.pop(key).cancel()
        for key in wanted:
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._follow(*key), name=f"peer-{key[0]}")

    async def _follow(self, node_id: str, addr: str) -> None:
        warned_tls = warned_token = False
        while True:
            try:
                stub = agent_pb2_grpc.AgentServiceStub(self.channels.get(addr))
                call = stub.Liveness(agent_pb2.LivenessRequest(from_node_id=self.node_id, interval_s=self.interval),
                                     metadata=self.token.metadata())
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                if "andshake" in (exc.details() or "") and warned_tls is False:
                    warned_tls = True  # death is then seen only when the lease expires: say why, once
                    log.warning("the TLS handshake with %s's agent at %s failed (%s); check that its certificate "
                                "names that address and that both use the job's CA", node_id, addr, exc.details())
                elif exc.code() == grpc.StatusCode.UNAUTHENTICATED and not warned_token:
                    warned_token = True
                    log.warning("%s's agent at %s refused this agent's liveness stream (%s); is it an agent of "
                                "another job? Its death is seen only when its lease expires", node_id, addr,
                                exc.details())
                log.debug("liveness stream to %s broke: %s", node_id, exc.code().name)
            if await tcp_refused(addr):
                await self.on_dead(node_id, f"its agent at {addr} refuses connections")
                return
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
