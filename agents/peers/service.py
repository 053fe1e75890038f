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
from dataclasses import dataclass
from typing import Protocol

import grpc
import grpc.aio

from ftrt.auth import JobToken, require_token
from ftrt.agents.peers.claims import ReplicaBusy, ReplicaGate, ReplicaRefused
from ftrt.agents.peers.tls import PLAINTEXT, AgentTls
from ftrt.agents.workers.pool import Worker
from ftrt.roster import LocalRound
from ftrt.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentStatus:
    """What the service tells about its agent: a snapshot taken for each call."""

    job_id: str
    node_id: str
    round: int
    """The round this node's workers run in (0 before the first)."""
    state: str
    current: LocalRound | None
    """The job's current round as the agent sees it."""
    workers: list[Worker]
    warm_workers: int
    max_restarts: int


class StatusSource(Protocol):
    """The service's view of its agent (:class:`~ftrt.agents.agent.Agent` is one)."""

    def status(self) -> AgentStatus: ...


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Answers for one agent: its status from ``source``, replicas into ``mem_dir`` for callers
    that show ``token`` and that ``gate`` admits (their owner claimed them)."""

    def __init__(self, source: StatusSource, mem_dir: str, token: JobToken, gate: ReplicaGate) -> None:
        self.source = source
        self.mem_dir = mem_dir
        self.token = token
        self.gate = gate
        self.started = time.monotonic()

    def _health(self, st: AgentStatus) -> agent_pb2.HealthResponse:
        return agent_pb2.HealthResponse(
            job_id=st.job_id, node_id=st.node_id, round=st.round, state=st.state, pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
        )

    async def _authorize(self, context, call: str, what: str) -> None:
        """Abort the call with UNAUTHENTICATED unless it shows the job's token (:mod:`ftrt.auth`)."""
        await require_token(self.token, context, f"This call {what} and needs the job's token, which it did not "
                            "show; the job's agents hold it, and ftrt status reads it from the job's etcd.",
                            call=call)

    async def Health(self, request, context):
        return self._health(self.source.status())

    async def Status(self, request, context):
        await self._authorize(context, "Status", "tells about the job's nodes and workers")
        st = self.source.status()
        rnd = st.current
        now = time.monotonic()
        workers = [
            agent_pb2.WorkerStatus(
                local_rank=w.local_rank, rank=w.rank, pid=w.pid, state=w.state.value, step=w.step,
                last_heartbeat_age_s=(now - w.last_heartbeat) if w.last_heartbeat else -1.0,
                exit_code=w.exit_code if w.exit_code is not None else 0, since_round=w.since_round,
            )
            for w in st.workers
        ]
        return agent_pb2.StatusResponse(
            health=self._health(st),
            group_rank=rnd.group_rank(st.node_id) if rnd else -1,
            world_size=rnd.world_size if rnd else 0,
            restarts=rnd.restart_count if rnd else 0,
            max_restarts=st.max_restarts,
            workers=workers,
            warm_workers=st.warm_workers,
            replicas_refused=self.gate.refused,
        )

    async def Liveness(self, request, context):
        await self._authorize(context, "Liveness", "feeds a peer's death detection")
        interval = min(max(request.interval_s or 0.5, 0.05), 10.0)
        while True:
            st = self.source.status()
            yield agent_pb2.LivenessBeat(node_id=st.node_id, round=st.round, time=time.time())
            await asyncio.sleep(interval)


    async def PutReplica(self, request_iterator, context):
        from ftrt.agents.peers.replicator import receive_replica

        await self._authorize(context, "PutReplica", "stores a memory checkpoint on this node")
        try:
            return await receive_replica(self.mem_dir, request_iterator, self.gate, context.auth_context())
        except ReplicaRefused as exc:  # not what its owner claimed: logged and counted by the gate
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ReplicaBusy as exc:  # refused at its start: nothing was written
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:  # a bad name, index or size from the wire: nothing was stored
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))


def bind_server(host: str, port: int, tls: AgentTls = PLAINTEXT) -> tuple[grpc.aio.Server, int]:
    """A server listening on ``host:port`` (0: a free port), with mutual TLS when ``tls`` is
    enabled, not serving yet (:func:`serve`): its address goes into the node record before the
    agent that answers exists. Returns the server and its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    if tls.enabled:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        from ftrt.errors import ConfigError

        raise ConfigError(f"The agent could not listen on {host}:{port}; pick another --agent-port.")
    return server, bound


async def serve(server: grpc.aio.Server, servicer: AgentServicer) -> None:
    """Start answering on a bound server."""
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    await server.start()


async def health(addr: str, timeout: float = 1.0, tls: AgentTls = PLAINTEXT) -> agent_pb2.HealthResponse:
    """Ask the agent at ``addr`` for its health (raises grpc.aio.AioRpcError on failure)."""
    async with tls.channel(addr) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        return await stub.Health(agent_pb2.HealthRequest(), timeout=timeout)


async def status(addr: str, token: JobToken, timeout: float = 1.0,
                 tls: AgentTls = PLAINTEXT) -> agent_pb2.StatusResponse:
    """Ask the agent at ``addr`` for its status, showing the job's ``token``."""
    async with tls.channel(addr) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        return await stub.Status(agent_pb2.StatusRequest(), timeout=timeout, metadata=token.metadata())
