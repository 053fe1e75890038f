"""The agent's gRPC service (``ftrt.v1.AgentService``): health, status and liveness streams.

Peers hold a :meth:`Liveness` stream open to each other: the server sends a beat every interval,
and when this agent's process dies the kernel closes the connection, so the peer learns of the
death in milliseconds instead of waiting for the lease to run out (see :mod:`.peers`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from ftrt.agents.tls import PLAINTEXT, AgentTls
from ftrt.v1 import agent_pb2, agent_pb2_grpc

if TYPE_CHECKING:
    from ftrt.agents.agent import Agent

log = logging.getLogger(__name__)


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Answers for one :class:`~ftrt.agents.agent.Agent`."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
        self.started = time.monotonic()

    def _health(self) -> agent_pb2.HealthResponse:
        a = self.agent
        return agent_pb2.HealthResponse(
            job_id=a.cfg.job_id,
            node_id=a.cfg.node_id,
            round=a.worker_round,
            state=a.state.value,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
        )

    async def _authorize(self, context) -> None:
        """Abort the call with UNAUTHENTICATED unless it shows the job's token (:mod:`.auth`)."""
        token = self.agent.token
        if token is None or not token.allows(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "This call changes the agent's state and needs the job's token, which it did not "
                                "show; only the job's own agents hold it.")

    async def Health(self, request, context):
        return self._health()

    async def Status(self, request, context):
        a = self.agent
        rnd = a.rdzv.view.round if a.rdzv else None
        now = time.monotonic()
        workers = [
            agent_pb2.WorkerStatus(
                local_rank=w.local_rank, rank=w.rank, pid=w.pid, state=w.state, step=w.step,
                last_heartbeat_age_s=(now - w.last_heartbeat) if w.last_heartbeat else -1.0,
                exit_code=w.exit_code if w.exit_code is not None else 0,
            )
            for w in (a.pool.running + a.pool.spares if a.pool else [])
        ]
        return agent_pb2.StatusResponse(
            health=self._health(),
            group_rank=rnd.group_rank(a.cfg.node_id) if rnd else -1,
            world_size=rnd.world_size if rnd else 0,
            restarts=rnd.restart_count if rnd else 0,
            max_restarts=a.cfg.max_restarts,
            workers=workers,
            warm_workers=a.pool.warm_count if a.pool else 0,
        )

    async def Liveness(self, request, context):
        interval = min(max(request.interval_s or 0.5, 0.05), 10.0)
        while True:
            yield agent_pb2.LivenessBeat(
                node_id=self.agent.cfg.node_id, round=self.agent.worker_round, time=time.time()
            )
            await asyncio.sleep(interval)


    async def PutReplica(self, request_iterator, context):
        from ftrt.agents.replicator import receive_replica

        await self._authorize(context)
        try:
            return await receive_replica(self.agent.mem_dir, request_iterator)
        except ValueError as exc:  # a bad name, index or size from the wire: nothing was stored
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))


async def start_server(agent: "Agent", host: str, port: int, tls: AgentTls = PLAINTEXT
                       ) -> tuple[grpc.aio.Server, int]:
    """Start the service on ``host:port`` (0: a free port), with mutual TLS when ``tls`` is
    enabled; return the server and its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(agent), server)
    if tls.enabled:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        from ftrt.errors import ConfigError

        raise ConfigError(f"The agent could not listen on {host}:{port}; pick another --agent-port.")
    await server.start()
    return server, bound


async def health(addr: str, timeout: float = 1.0, tls: AgentTls = PLAINTEXT) -> agent_pb2.HealthResponse:
    """Ask the agent at ``addr`` for its health (raises grpc.aio.AioRpcError on failure)."""
    async with tls.channel(addr) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        return await stub.Health(agent_pb2.HealthRequest(), timeout=timeout)


async def status(addr: str, timeout: float = 1.0, tls: AgentTls = PLAINTEXT) -> agent_pb2.StatusResponse:
    """Ask the agent at ``addr`` for its status."""
    async with tls.channel(addr) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        return await stub.Status(agent_pb2.StatusRequest(), timeout=timeout)
