"""Everything an agent works with, built once and in dependency order (:func:`assemble`).

No part starts as None to be filled in later: :func:`assemble` connects to etcd, reads the job's
token, adopts the spares ``ftrt launch`` started early, binds the gRPC server, and wires the pool,
the rendezvous and the peer monitor to one another, registering each on an exit stack as it is
built so that a failed step leaves nothing behind and the rest closes in order (workers before the
lease, the store last).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc.aio

from ftrt import reports, tmpdirs
from ftrt.agents.config import LaunchConfig
from ftrt.agents.rendezvous.decide import RendezvousConfig
from ftrt.agents.ops.events import EventLog, open_event_file
from ftrt.agents.inbox import Inbox
from ftrt.agents.rendezvous.membership import Membership
from ftrt.agents.peers.monitor import MONITORED_PEERS, PeerMonitor
from ftrt.agents.ops.probes import Probes
from ftrt.agents.rendezvous.rendezvous import Rendezvous
from ftrt.agents.peers.claims import ClaimBook, ReplicaGate
from ftrt.agents.peers.replicator import Replicator
from ftrt.agents.peers.service import bind_server
from ftrt.agents.states import AgentState
from ftrt.agents.ops.telemetry import Metrics, metrics_for
from ftrt.agents.peers.tls import PeerChannels
from ftrt.agents.workers.early import EarlyStart
from ftrt.agents.workers.fence import FenceWriter
from ftrt.agents.workers.pool import Worker, WorkerPool
from ftrt.auth import JobToken, job_token
from ftrt.errors import StoreError, StoreUnavailable
from ftrt.jobkeys import JobKeys
from ftrt.roster import NotLoaded
from ftrt.roundendfile import RoundEndWriter
from ftrt.store.access import EtcdAccess
from ftrt.store.api import Store
from ftrt.store.certs import tls_dir
from ftrt.store.etcd import EtcdStore, parse_endpoints, unreachable
from ftrt.store.etcd_server import EtcdServer

log = logging.getLogger(__name__)


def detect_host(endpoints: str) -> str:
    """The local address that routes to the first etcd endpoint (loopback for a local etcd)."""
    host, port = parse_endpoints(endpoints)[0]
    try:
        ip = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror:
        return "127.0.0.1"
    if ip.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, port))
            return s.getsockname()[0]
    except OSError:
        return ip


@dataclass
class NodeState:
    """What this node is doing, written by its agent and read by the parts that report it (event
    log, log lines, the gRPC service): its state's kind and the round it last acted on."""

    state: AgentState = AgentState.STARTING
    worker_round: int = 0
    """The round this node's workers run in (0 before the first)."""


class _Prefix(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        node: NodeState = self.extra["node"]
        return f"[node={self.extra['node_id']} round={node.worker_round or '-'}] {msg}", kwargs


@dataclass
class AgentParts:
    """Everything an agent works with, each built once and in dependency order by :func:`assemble`,
    whose exit stack closes them in the right order (workers before the lease, the store last)."""

    cfg: LaunchConfig
    keys: JobKeys
    node: NodeState
    log: logging.LoggerAdapter
    host: str
    endpoints: str
    etcd_access: EtcdAccess
    """How this agent and its workers reach etcd: ``--etcd-*``, or the standalone etcd's own."""
    agent_addr: str
    store: Store
    fence: FenceWriter
    round_end: RoundEndWriter
    mem_dir: str
    token: JobToken
    metrics: Metrics
    events: EventLog
    replicator: Replicator
    inbox: Inbox
    pool: WorkerPool
    membership: Membership
    rdzv: Rendezvous
    monitor: PeerMonitor
    channels: PeerChannels
    probes: Probes
    gate: ReplicaGate
    """What this node checks replicas from its peers against (their owners' claims)."""


async def assemble(cfg: LaunchConfig, *, early: EarlyStart | None = None, store: Store | None = None,
                   stack: contextlib.AsyncExitStack) -> tuple[AgentParts, grpc.aio.Server]:
    """Build an agent's parts: connect to etcd, read the job's token, adopt the early spares, bind the
    gRPC server (returned, to :func:`~ftrt.agents.peers.service.serve` once the agent exists), and wire the
    pool, rendezvous and peer monitor to one another. Whatever was built is registered on ``stack``
    as it is built, so a failed step leaves nothing behind."""
    node = NodeState()
    alog = _Prefix(log, {"node": node, "node_id": cfg.node_id})
    keys = JobKeys(cfg.job_id)
    # Spares first: their torch import is the slow part of joining, so it overlaps with everything
    # else the agent does before it can join. The CLI may have started them already.
    early = early or EarlyStart.for_config(cfg)
    stack.callback(tmpdirs.remove, early.mem_dir)
    stack.callback(tmpdirs.remove, early.run_dir)
    stack.callback(early.round_end.close)
    stack.callback(early.fence.close)
    host = cfg.host or ("127.0.0.1" if cfg.standalone else detect_host(cfg.etcd or ""))
    endpoints, access = cfg.etcd or "", cfg.etcd_access
    if cfg.standalone:  # closed as ftrt etcd is: only this agent and its workers hold the certificate
        tls = await asyncio.to_thread(tls_dir, Path(early.run_dir) / "etcd-tls", ("ftrt",))
        etcd = EtcdServer(name=f"ftrt-{cfg.job_id}", unsafe_no_fsync=True, tls=tls)
        stack.push_async_callback(asyncio.to_thread, etcd.stop)
        etcd.start(wait=False)  # from the loop's thread, which lives as long as the agent: etcd dies with it
        await asyncio.to_thread(etcd.wait_ready)
        endpoints, access = etcd.endpoint, etcd.access()
        alog.info("standalone: embedded etcd on %s (TLS, client certificates)", endpoints)
    elif not access.identifies and not cfg.insecure_etcd:
        alog.warning("etcd at %s: this agent shows it no client certificate and no user, so nothing tells etcd to "
                     "refuse anyone: anyone who can reach it can read the job's token and join or rewrite the job. "
                     "Use the etcd ftrt etcd starts (closed by default), secure yours (docs/security.md), or pass "
                     "--insecure-etcd to run open knowingly.", endpoints)
    if store is None:
        store = EtcdStore(endpoints, timeout=3.0, access=access)
    stack.push_async_callback(store.close)
    try:
        await store.get(keys.root, timeout=5.0)
    except StoreUnavailable as exc:
        raise unreachable(endpoints, 5.0, standalone=True) from exc
    token = await job_token(store, keys)
    channels = PeerChannels(cfg.agent_tls)
    stack.push_async_callback(channels.close)  # after the replicator and the monitor (closed first)
    event_file = open_event_file(cfg.event_log) if cfg.event_log else None
    if event_file is not None:
        stack.callback(event_file.close)
    events = EventLog(store, keys, cfg.node_id, file=event_file, round_of=lambda: node.worker_round)
    stack.push_async_callback(events.flush)
    inbox = Inbox()
    server, port = bind_server(host, cfg.agent_port, cfg.agent_tls)
    stack.push_async_callback(server.stop, 0.2)
    agent_addr = f"{host}:{port}"
    probes = Probes()
    probes.add_to(server)  # grpc.health.v1 on the agent's own port
    if cfg.health_port is not None:
        hport = probes.serve_http(host, cfg.health_port)
        stack.callback(probes.close)
        alog.info("health probes on http://%s:%d/healthz and /readyz", host, hport)
    # Closed in reverse: the workers stop first, then the rendezvous (its slot freed), then the lease.
    membership = Membership(store, keys, node_id=cfg.node_id, host=host, agent_addr=agent_addr,
                            nproc=cfg.nproc_per_node, lease_ttl=cfg.lease_ttl, on_renew=early.fence.set, log=alog)
    stack.push_async_callback(membership.close)
    replicator = Replicator(cfg.node_id, early.mem_dir, token,
                            ClaimBook(store, keys, cfg.node_id, host, membership.registration),
                            cfg.replica_interval, channels)
    stack.push_async_callback(replicator.close)
    gate = ReplicaGate(store, keys)
    metrics = metrics_for(cfg.metrics_port is not None, cfg.node_id, etcd_errors=lambda: getattr(store, "errors", 0),
                          replicas=replicator.replicated, replicas_refused=lambda: gate.refused)
    rdzv = Rendezvous(
        store, keys, cfg.node_id,
        RendezvousConfig(
            min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, settle_s=cfg.settle,
            join_settle_s=cfg.join_settle, first_round_wait_s=cfg.first_round_wait,
            join_timeout_s=cfg.join_timeout, max_restarts=cfg.max_restarts,
        ),
        registration=membership.registration, on_event=lambda kind, msg: events.emit(kind, msg),
        on_change=inbox.poke, successors=neighbours(cfg) + 1,
    )
    stack.push_async_callback(rdzv.close)
    pool = WorkerPool(
        nproc=cfg.nproc_per_node, fence_path=early.fence.path, warm=cfg.warm_workers,
        warm_imports=cfg.warm_imports, base_env=early.base_env, log_dir=cfg.log_dir,
        on_exit=inbox.worker_exited, on_memory=lambda rank, step: _replicate(replicator, pool, rank),
        on_heartbeat=lambda w: metrics.heartbeat(w.rank, w.taken_round, w.step),
        on_report=_report_handler(metrics, events, alog),
    )
    stack.push_async_callback(pool.close, cfg.stop_grace)
    pool.adopt_spares(early.take_spawned())
    template = early.take_template()
    if template is not None:
        pool.adopt_template(*template)
    pool.fill_spares()
    monitor = PeerMonitor(cfg.node_id, token, _peer_death_handler(rdzv, store, metrics, events, alog),
                          cfg.peer_check_interval, channels)
    stack.push_async_callback(monitor.close)
    if cfg.metrics_port is not None:
        from ftrt.agents.ops.metrics import serve as serve_metrics

        metrics_server, mport = serve_metrics(metrics, host, cfg.metrics_port)
        stack.callback(metrics_server.server_close)
        stack.callback(metrics_server.shutdown)
        alog.info("Prometheus metrics on http://%s:%d/metrics", host, mport)
    return AgentParts(
        cfg=cfg, keys=keys, node=node, log=alog, host=host, endpoints=endpoints, etcd_access=access,
        agent_addr=agent_addr,
        store=store, fence=early.fence, round_end=early.round_end, mem_dir=early.mem_dir, token=token,
        metrics=metrics, events=events, replicator=replicator, inbox=inbox, pool=pool, membership=membership,
        rdzv=rdzv, monitor=monitor, channels=channels, probes=probes, gate=gate,
    ), server


def neighbours(cfg: LaunchConfig) -> int:
    """How many ring successors an agent works with: the peers it monitors and those it replicates
    to (it also keeps a channel dialled to the one after them)."""
    return max(MONITORED_PEERS, cfg.replicas)


def _report_handler(metrics: Metrics, events: EventLog, alog: logging.LoggerAdapter):
    """A worker's checkpoint, restore or trainer report: metrics, and events for the rare ones."""

    def on_report(worker: Worker, report: reports.Report) -> None:
        metrics.report(report)
        match report:
            case reports.Restored(tier=tier, step=step, seconds=seconds):
                events.emit("restore", f"rank {worker.rank} restored step {step} from {tier} in {seconds:.2f} s",
                            rank=worker.rank, tier=tier, step=step, seconds=seconds)
            case reports.Committed(tier=tier, step=step, save_s=seconds, bytes=size):
                events.emit("checkpoint_committed", f"checkpoint step {step} committed to {tier} in {seconds:.2f} s",
                            local=True, tier=tier, step=step, seconds=seconds, bytes=size)

    return on_report


def _peer_death_handler(rdzv: Rendezvous, store: Store, metrics: Metrics, events: EventLog,
                        alog: logging.LoggerAdapter):
    """What to do when a peer's liveness stream says it died: revoke its lease, so every agent sees
    its registration go at once instead of after its TTL."""

    async def on_dead(node_id: str, reason: str) -> None:
        rnd = rdzv.view.round
        try:
            rec = rnd.member(node_id) if rnd else None
        except NotLoaded:
            rec = None  # not a peer this agent monitors in the current round
        if rec is None or not rec.lease:
            return
        alog.warning("peer %s is dead (%s); revoking its lease", node_id, reason)
        metrics.fault("node_lost")
        events.emit("node_lost", f"{node_id}: {reason}", lost=node_id, evidence=reason)
        try:
            await store.revoke_lease(rec.lease, timeout=2.0)
        except StoreError as exc:
            alog.warning("could not revoke the lease of %s: %s", node_id, exc)

    return on_dead


def _replicate(replicator: Replicator, pool: WorkerPool, rank: int) -> None:
    """A worker saved a memory checkpoint of ``rank``: send it to the peers, and drop the ones of
    ranks this node's workers no longer hold (they changed ranks in place)."""
    replicator.notify(rank)
    replicator.prune({w.rank for w in pool.running if w.rank >= 0})
