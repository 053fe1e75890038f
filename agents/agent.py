"""The per-node agent: membership, rounds, workers, fencing. ``ftrt launch`` runs one.

The agent is a state machine (:mod:`.states`) driven by one loop. Each pass looks at everything
that may have changed (the lease, the job's terminal state, exited or hung workers, the current
round) and acts; every step is idempotent, so a pass can be triggered by any source:

- the :class:`~.rendezvous.Rendezvous` view changing (a watch event),
- a worker exiting, a peer found dead, a stop signal,
- and a 0.5 s tick (hang checks, lease checks).

Recovery paths and what bounds their time:

- a peer's process dies: its liveness stream breaks and its port refuses connections; we revoke
  its lease; every agent sees the key vanish; the next round is written after ``settle`` s;
- a local worker fails: the other local workers stop, a restart request is written (fenced by
  the round); the next round follows after ``settle`` s;
- in either case the new round starts from warm spares: no interpreter boot, no torch import.

:func:`assemble` builds every part the agent uses, in dependency order and each once (none starts
as None to be filled in later); :func:`main` serves the gRPC service (which sees the agent only as
a :class:`~ftrt.agents.service.StatusSource`), runs the agent and closes the parts in order.
Events reach the loop through one :class:`Inbox`, and a local failure (an exit or a hang) takes
one route, :meth:`Agent._fail_round`, awaited by the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from dataclasses import dataclass

import grpc.aio

from ftrt import reports
from ftrt.auth import JobToken, job_token
from ftrt.agents.workers.boundary import boundary_timeout, planned_change
from ftrt.agents.config import LaunchConfig
from ftrt.agents.decide import RendezvousConfig
from ftrt.agents.workers.early import EarlyStart
from ftrt.agents.events import EventLog, open_event_file
from ftrt.agents.workers.fence import FenceWriter
from ftrt.agents.workers.hangs import find_hung
from ftrt.agents.membership import Membership
from ftrt.agents.peers import MONITORED_PEERS, PeerMonitor
from ftrt.agents.probes import Probes, judge
from ftrt.agents.tls import PeerChannels
from ftrt.agents.rendezvous import Rendezvous
from ftrt.agents.replicator import Replicator
from ftrt.agents.service import AgentServicer, AgentStatus, bind_server, serve
from ftrt.agents.states import AgentState, check_transition
from ftrt.agents.telemetry import Metrics, metrics_for
from ftrt.agents.workers.env import recorded_error, worker_env
from ftrt.agents.workers.pool import Worker, WorkerPool
from ftrt.agents.workers.warmup import change_interval, idle_warm_grace
from ftrt.checkpoint.cadence import estimate_mtbf
from ftrt.errors import FtrtError, LeaseLost, RoundChanged, StoreError, StoreUnavailable, WorkerFailure
from ftrt.jobkeys import JobKeys
from ftrt.roster import LocalRound, NotLoaded
from ftrt.roundendfile import RoundEndWriter
from ftrt.store.api import Store
from ftrt.store.etcd import EtcdStore, parse_endpoints
from ftrt.store.etcd_server import EtcdServer

log = logging.getLogger(__name__)

SPARE_REFILL_DELAY = 0.5
"""Seconds after a round starts before used spares are replaced (at idle CPU priority, so they
only use what the running workers leave; a spare needed before it is warm is boosted)."""


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
    log, log lines, the gRPC service)."""

    state: AgentState = AgentState.STARTING
    worker_round: int = 0
    """The round this node's workers run in (0 before the first)."""


@dataclass
class Drain:
    """A drain in progress: why, and until when it may take (the agent's monotonic clock)."""

    reason: str
    started: float
    deadline: float
    member: bool
    """Whether this node was in the current round when the drain began (a node that is not, say one
    that rejoined after losing its lease and waits to be admitted, has nothing to hand over)."""
    below_min_said: bool = False


class _Prefix(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        node: NodeState = self.extra["node"]
        return f"[node={self.extra['node_id']} round={node.worker_round or '-'}] {msg}", kwargs


class StopSignal:
    """SIGINT and SIGTERM, caught from before the agent is assembled until everything it built is
    closed. With ``drain``, the first SIGTERM asks the agent to drain (leave gracefully,
    :meth:`Agent._begin_drain`); SIGINT, or a SIGTERM after that, stops it at once. Once stopping,
    further signals are ignored, so cleanup is not cut short."""

    def __init__(self, drain: bool = False) -> None:
        self.signum: int | None = None
        """The signal that stops the agent at once, or None."""
        self.drain_asked = False
        """A SIGTERM asked for a drain."""
        self._drain = drain
        self._listeners: list = []

    def catch(self, signum: int) -> None:
        if self.signum is not None:
            return
        if signum == signal.SIGTERM and self._drain and not self.drain_asked:
            self.drain_asked = True
            log.info("received SIGTERM; draining (a second SIGTERM stops at once)")
        else:
            self.signum = signum
            log.info("received %s; stopping", signal.Signals(signum).name)
        for listener in self._listeners:
            listener()

    def on_stop(self, listener) -> None:
        self._listeners.append(listener)


class Inbox:
    """What reaches the agent's loop from other tasks: exited workers, and pokes (a view change, a
    stop signal, a peer found dead). The loop is its one consumer. A change is counted, not
    cleared, so a wait never loses one that came while the loop was busy."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()
        self._exited: list[Worker] = []

    def poke(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    def worker_exited(self, worker: Worker) -> None:
        self._exited.append(worker)
        self.poke()

    def take_exited(self) -> list[Worker]:
        exited, self._exited = self._exited, []
        return exited

    async def wait(self, since: int, timeout: float) -> None:
        """Return once something arrived after ``since`` (a :attr:`version`), or after ``timeout``."""
        if self.version > since:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


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


async def assemble(cfg: LaunchConfig, *, early: EarlyStart | None = None, store: Store | None = None,
                   stack: contextlib.AsyncExitStack) -> tuple[AgentParts, grpc.aio.Server]:
    """Build an agent's parts: connect to etcd, read the job's token, adopt the early spares, bind the
    gRPC server (returned, to :func:`~ftrt.agents.service.serve` once the agent exists), and wire the
    pool, rendezvous and peer monitor to one another. Whatever was built is registered on ``stack``
    as it is built, so a failed step leaves nothing behind."""
    node = NodeState()
    alog = _Prefix(log, {"node": node, "node_id": cfg.node_id})
    keys = JobKeys(cfg.job_id)
    # Spares first: their torch import is the slow part of joining, so it overlaps with everything
    # else the agent does before it can join. The CLI may have started them already.
    early = early or EarlyStart.for_config(cfg)
    stack.callback(shutil.rmtree, early.mem_dir, ignore_errors=True)
    stack.callback(shutil.rmtree, early.run_dir, ignore_errors=True)
    stack.callback(early.round_end.close)
    stack.callback(early.fence.close)
    host = cfg.host or ("127.0.0.1" if cfg.standalone else detect_host(cfg.etcd or ""))
    endpoints = cfg.etcd or ""
    if cfg.standalone:
        etcd = EtcdServer(name=f"ftrt-{cfg.job_id}", unsafe_no_fsync=True)
        stack.push_async_callback(asyncio.to_thread, etcd.stop)
        await asyncio.to_thread(etcd.start)
        endpoints = etcd.endpoint
        alog.info("standalone: embedded etcd on %s", endpoints)
    if store is None:
        store = EtcdStore(endpoints, timeout=3.0, access=cfg.etcd_access)
    stack.push_async_callback(store.close)
    try:
        await store.get(keys.root, timeout=5.0)
    except StoreUnavailable as exc:
        raise StoreUnavailable(
            f"Cannot reach etcd at {endpoints} within 5 s. Start etcd there (ftrt etcd), "
            "fix --etcd, or use --standalone for a single-node job."
        ) from exc
    token = await job_token(store, keys)
    channels = PeerChannels(cfg.agent_tls)
    stack.push_async_callback(channels.close)  # after the replicator and the monitor (closed first)
    replicator = Replicator(cfg.node_id, early.mem_dir, token, cfg.replica_interval, channels)
    stack.push_async_callback(replicator.close)
    metrics = metrics_for(cfg.metrics_port is not None, cfg.node_id,
                          etcd_errors=lambda: getattr(store, "errors", 0), replicas=replicator.replicated)
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
        on_exit=inbox.worker_exited, on_memory=lambda rank, step: replicator.notify(rank),
        on_heartbeat=lambda w: metrics.heartbeat(w.rank, w.round, w.step),
        on_report=_report_handler(metrics, events, alog),
    )
    stack.push_async_callback(pool.close, cfg.stop_grace)
    pool.adopt_spares(early.take_spawned())
    template = early.take_template()
    if template is not None:
        pool.adopt_template(*template)
    pool.fill_spares()
    monitor = PeerMonitor(cfg.node_id, _peer_death_handler(rdzv, store, metrics, events, alog),
                          cfg.peer_check_interval, channels)
    stack.push_async_callback(monitor.close)
    if cfg.metrics_port is not None:
        from ftrt.agents.metrics import serve as serve_metrics

        metrics_server, mport = serve_metrics(metrics, host, cfg.metrics_port)
        stack.callback(metrics_server.server_close)
        stack.callback(metrics_server.shutdown)
        alog.info("Prometheus metrics on http://%s:%d/metrics", host, mport)
    return AgentParts(
        cfg=cfg, keys=keys, node=node, log=alog, host=host, endpoints=endpoints, agent_addr=agent_addr,
        store=store, fence=early.fence, round_end=early.round_end, mem_dir=early.mem_dir, token=token,
        metrics=metrics, events=events, replicator=replicator, inbox=inbox, pool=pool, membership=membership,
        rdzv=rdzv, monitor=monitor, channels=channels, probes=probes,
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


class Agent:
    """One node's agent, with every part built (:func:`assemble`). ``await agent.run()`` joins the
    job, drives its rounds and returns the process exit code; :func:`run_agent` does it all."""

    def __init__(self, parts: AgentParts, stop: StopSignal) -> None:
        self.stop = stop
        self.cfg = parts.cfg
        self.keys = parts.keys
        self.node = parts.node
        self.log = parts.log
        self.host = parts.host
        self.endpoints = parts.endpoints
        self.agent_addr = parts.agent_addr
        self.store = parts.store
        self.token = parts.token
        self.metrics = parts.metrics
        self.mem_dir = parts.mem_dir
        self.replicator = parts.replicator
        self.pool = parts.pool
        self.membership = parts.membership
        self.rdzv = parts.rdzv
        self.inbox = parts.inbox
        self._events = parts.events
        self._monitor = parts.monitor
        self._channels = parts.channels
        self._fence = parts.fence
        self._round_end = parts.round_end
        self._probes = parts.probes
        self._worker_record: LocalRound | None = None  # the round this node's workers run in
        self._finished_at = 0.0
        self._background: set[asyncio.Task] = set()
        self._notice: str | None = None  # a preemption notice (agents/preemption.py)
        self._drain: Drain | None = None

    @property
    def state(self) -> AgentState:
        return self.node.state

    @property
    def worker_round(self) -> int:
        return self.node.worker_round

    @worker_round.setter
    def worker_round(self, value: int) -> None:
        self.node.worker_round = value

    def status(self) -> AgentStatus:
        """A snapshot for the gRPC service (:class:`~ftrt.agents.service.StatusSource`)."""
        return AgentStatus(
            job_id=self.cfg.job_id, node_id=self.cfg.node_id, round=self.worker_round, state=self.state.value,
            current=self.rdzv.view.round, workers=self.pool.running + self.pool.spares,
            warm_workers=self.pool.warm_count, max_restarts=self.cfg.max_restarts,
        )

    # -- state ----------------------------------------------------------------------------------
    def _set_state(self, new: AgentState, why: str = "") -> None:
        if new is self.state:
            return
        check_transition(self.state, new)
        self.log.debug("state %s -> %s %s", self.state.value, new.value, why)
        self.node.state = new

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- entry ----------------------------------------------------------------------------------
    async def run(self) -> int:
        self.stop.on_stop(self.inbox.poke)
        if self.cfg.preemption_file or self.cfg.preemption_url:
            from ftrt.agents import preemption

            self._spawn(preemption.watch(self.cfg.preemption_file, self.cfg.preemption_url, self.cfg.preemption_poll,
                                         self._on_notice))
        try:
            await self._join()
            await self.rdzv.start()
            self._set_state(AgentState.WAITING)
            self.log.info(
                "joined job %r as %s (agent %s, %d worker(s), etcd %s)",
                self.cfg.job_id, self.cfg.node_id, self.agent_addr, self.cfg.nproc_per_node, self.endpoints,
            )
            return await self._loop()
        finally:
            for task in list(self._background):
                task.cancel()

    # -- membership -----------------------------------------------------------------------------
    async def _join(self) -> None:
        """Take a lease and register this node (a new incarnation)."""
        ready = (not self.cfg.warm_workers) or self.pool.warm_count >= self.cfg.nproc_per_node
        record = await self.membership.join(ready=ready)
        if not record.ready:
            self._spawn(self._announce_ready(record.incarnation))

    async def _announce_ready(self, incarnation: str) -> None:
        await self.pool.spares_ready()
        record = self.membership.record
        if record is None or record.incarnation != incarnation or record.ready:
            return
        await self.membership.update(ready=True)
        self.log.info("warm workers ready after %.2f s", time.monotonic() - self.pool.spares[0].spawned_at
                      if self.pool.spares else 0.0)

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> int:
        seen = -1
        while True:
            await self.inbox.wait(seen, 0.5)
            seen = self.inbox.version
            await self._update_probes()
            if self.stop.signum is not None:
                self._set_state(AgentState.STOPPED)
                return 128 + self.stop.signum
            if self.membership.expired():
                await self._fence_self()
                continue
            job = self.rdzv.view.job
            if job is not None:
                return await self._finish_job(job.state, job.reason)
            if self._drain is None and (why := self._drain_reason()) is not None:
                await self._begin_drain(why)
            await self._handle_exits()
            self._cut_stuck_teardowns()
            if (hang := self._find_hang()) is not None:
                await self._fail_round("hang", hang)
            if self.state is AgentState.FINISHED:
                if self._drain is not None:
                    self.log.info("draining after this node's workers finished: nothing to hand over; leaving")
                    self._set_state(AgentState.STOPPED)
                    return 0
                if time.monotonic() > self._finished_at + self.cfg.exit_barrier_timeout:
                    self.log.warning("other members did not finish within %.0f s; exiting", self.cfg.exit_barrier_timeout)
                    self._set_state(AgentState.SUCCEEDED)
                    return 0
                continue
            await self._reconcile()
            if self._drain is not None:
                code = await self._continue_drain()
                if code is not None:
                    return code
                continue  # the old round's peers keep this node's replicas until it has left
            self._update_peers()

    async def _finish_job(self, state: str, reason: str) -> int:
        await self.pool.stop_running(self.cfg.stop_grace)
        if state == "succeeded":
            self._set_state(AgentState.SUCCEEDED)
            self.log.info("job succeeded")
            return 0
        self._set_state(AgentState.FAILED)
        raise WorkerFailure(f"The job failed: {reason}.")

    async def _fence_self(self) -> None:
        reason = self.membership.lost_reason() or "the lease ran out before it could be renewed"
        self.log.error("lost membership (%s): stopping workers now", reason)
        self._fence.fence()
        self.pool.kill_running_now()
        await self.pool.stop_running(0.0)
        self.membership.orphan()
        self._set_state(AgentState.FENCED)
        self.metrics.fault("fenced")
        self._events.emit("fenced", f"{self.cfg.node_id} fenced itself: {reason}", evidence=reason)
        while self.stop.signum is None and self._drain is None and self._drain_reason() is None:
            try:
                await self._join()
                break
            except (StoreError, LeaseLost) as exc:
                self.log.warning("rejoining failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
        if self.stop.signum is not None or self._drain is not None or self._drain_reason() is not None:
            return  # stopped or draining while fenced: its workers are gone already, the loop ends the agent
        self._set_state(AgentState.WAITING)
        self.log.info("rejoined as a new member")

    async def _handle_exits(self) -> None:
        exited = self.inbox.take_exited()
        failed = [w for w in exited if w.round == self.worker_round and w.exit_code != 0 and not w.teardown_cut]
        if failed and self.state is AgentState.RUNNING:
            w = failed[0]
            detail = f"rank {w.rank} (pid {w.pid}) exited with code {w.exit_code}"
            cause = recorded_error(Path(self.mem_dir) / "errors" / f"round-{w.round}" / f"rank-{w.rank}.json")
            if cause:
                detail += f": {cause}"
            await self._fail_round("failure", detail)
            return
        running = self.pool.running
        if self.state is AgentState.RUNNING and running and all(w.exit_code == 0 or w.teardown_cut for w in running):
            self.pool.finished()
            self._set_state(AgentState.FINISHED)
            self._finished_at = time.monotonic()
            self.log.info("all workers exited 0 in round %d", self.worker_round)
            self._events.emit("node_done", f"{self.cfg.node_id} finished in round {self.worker_round}")
            await self.membership.update(done_round=self.worker_round)

    def _cut_stuck_teardowns(self) -> None:
        """Kill the workers done with their work whose exit is overdue (``--teardown-timeout``)."""
        if self.state is not AgentState.RUNNING:
            return
        done = [w for w in self.pool.running if w.done_at is not None and w.exit_code is None and not w.teardown_cut]
        overdue = {rank for rank, _ in find_hung(time.monotonic(), [(w.rank, w.done_at) for w in done],
                                                   self.cfg.teardown_timeout)}
        for w in done:
            if w.rank in overdue:
                self.log.warning("rank %d said its work was done and has not exited %g s later (--teardown-timeout): "
                                 "its teardown is stuck (e.g. a process group's destructor at interpreter exit); "
                                 "killed it, its work counts as finished", w.rank, self.cfg.teardown_timeout)
                self._events.emit("teardown_cut", f"rank {w.rank} killed {self.cfg.teardown_timeout:g} s after it "
                                  "said it was done", rank=w.rank)
                self.pool.cut_teardown(w)

    def _find_hang(self) -> str | None:
        """A running worker silent past ``--hang-timeout`` (after its first heartbeat, until it
        said it is done), as the failure's detail; None if none."""
        if self.state is not AgentState.RUNNING:
            return None
        hung = find_hung(
            time.monotonic(),
            [(w.rank, w.last_heartbeat) for w in self.pool.running if w.exit_code is None and w.done_at is None],
            self.cfg.hang_timeout,
        )
        if not hung:
            return None
        rank, silent = hung[0]
        return f"rank {rank} sent no heartbeat for {silent:.1f} s (timeout {self.cfg.hang_timeout:g} s)"

    async def _fail_round(self, kind: str, detail: str) -> None:
        """The one route of a local failure (an exit or a hang): stop the workers and ask for a
        restart of their round, unless another node's request replaced it already."""
        if self.state is not AgentState.RUNNING:
            return
        self._set_state(AgentState.WAITING)
        failed = self.worker_round  # captured: a new round may start while the workers stop
        self.log.warning("worker %s in round %d: %s; asking for a restart", kind, failed, detail)
        self.metrics.fault(f"worker_{kind}")
        self._events.emit(f"worker_{kind}", detail, round=failed, evidence=detail)
        await self.pool.stop_running(self.cfg.restart_grace)
        current = self.rdzv.view.round
        if self.worker_round != failed or current is None or current.round != failed:
            # Another node's report already replaced round `failed` (one hang stalls every rank's
            # heartbeat, so several agents see it): that round restarted these workers too.
            self.log.info("round %d was already replaced; no restart request needed", failed)
            return
        try:
            await self.rdzv.request_restart(failed, kind, detail)
        except StoreError as exc:
            self.log.warning("could not request a restart: %s", exc)

    async def _update_probes(self) -> None:
        rnd = self.rdzv.view.round
        try:
            in_round = self._included(rnd) and self.worker_round == rnd.round
        except NotLoaded:
            in_round = False
        await self._probes.update(judge(
            self.state, registered=self.membership.record is not None, expired=self.membership.expired(),
            draining=self._drain is not None, in_round=in_round, current_round=rnd.round if rnd is not None else None))

    # -- draining -------------------------------------------------------------------------------
    def _on_notice(self, why: str) -> None:
        self._notice = why
        self.inbox.poke()

    def _drain_reason(self) -> str | None:
        """Why this node should drain now (SIGTERM, a preemption notice, ``ftrt drain``), or None."""
        if self.stop.drain_asked:
            return "SIGTERM"
        if self._notice is not None:
            return f"preemption notice: {self._notice}"
        req = self.rdzv.jobview.drain
        record = self.membership.record
        if req is not None and record is not None and req.incarnation == record.incarnation:
            return f"ftrt drain{': ' + req.reason if req.reason else ''}"
        return None

    async def _begin_drain(self, why: str) -> None:
        """Leave gracefully: tell the workers, and ask for a round without this node (a planned
        change: every rank ends the round at a step boundary and saves it)."""
        now = time.monotonic()
        self._drain = Drain(why, now, now + self.cfg.drain_timeout, member=self._included(self.rdzv.view.round))
        self.log.warning("draining (%s): asking for a round without this node; leaving within %g s (--drain-timeout)",
                         why, self.cfg.drain_timeout)
        self._events.emit("drain_started", f"{self.cfg.node_id} drains: {why}", reason=why,
                          timeout=self.cfg.drain_timeout)
        self._round_end.drain()
        await self.membership.update(leaving=True)

    def _included(self, rnd: LocalRound | None) -> bool:
        me = rnd.member(self.cfg.node_id) if rnd is not None else None
        record = self.membership.record
        return bool(rnd is not None and rnd.active and me is not None and record is not None
                    and me.incarnation == record.incarnation)

    async def _continue_drain(self) -> int | None:
        """One pass of a drain: the exit code once this node has left, else None (keep going)."""
        drain = self._drain
        now = time.monotonic()
        if now >= drain.deadline:
            self.log.warning("the drain did not finish within %g s (--drain-timeout); leaving as a crash would",
                             self.cfg.drain_timeout)
            self._events.emit("drain_timeout", f"{self.cfg.node_id} left without finishing its drain ({drain.reason})",
                              reason=drain.reason)
            self._set_state(AgentState.STOPPED)
            return 128 + signal.SIGTERM
        record = self.membership.record
        if record is not None and not record.leaving:
            await self.membership.update(leaving=True)  # the first write failed: etcd was away
        rnd = self.rdzv.view.round
        if self._included(rnd) or self.pool.running:
            return None  # the decider has not written the round without this node yet
        if rnd is not None and not rnd.active and not drain.below_min_said:
            drain.below_min_said = True
            self.log.warning("without this node the job is below its minimum of %d nodes: it waits for a newcomer "
                             "(--join-timeout %g s)", self.cfg.min_nodes, self.cfg.join_timeout)
        kept = await self.replicator.flush(max(0.0, drain.deadline - time.monotonic()))
        if kept is False:
            self.log.warning("a sharded rank's newest memory checkpoint may not have reached a peer before the "
                             "drain's deadline; the job restores it from storage if it must")
        if drain.member:
            self.log.info("drained in %.2f s (%s); leaving", time.monotonic() - drain.started, drain.reason)
        else:
            self.log.info("drained in %.2f s (%s): this node was not in the job's current round, so it had nothing "
                          "to hand over; leaving", time.monotonic() - drain.started, drain.reason)
        self._events.emit("drained", f"{self.cfg.node_id} left the job gracefully ({drain.reason})",
                          reason=drain.reason, seconds=round(time.monotonic() - drain.started, 3))
        self._set_state(AgentState.STOPPED)
        return 0

    async def _reconcile(self) -> None:
        """Make this node's workers match the current round."""
        rnd = self.rdzv.view.round
        if rnd is None or rnd.round == self.worker_round:
            return
        included = self._included(rnd)
        if not included or self._drain is not None:  # a draining node starts no new workers
            if self.pool.running:
                if self._worker_record is not None:
                    await self._end_at_boundary(self._worker_record, rnd)
                await self.pool.stop_running(self.cfg.restart_grace)
                self.log.info("round %d %s; workers stopped", rnd.round,
                              f"does not include this node ({rnd.reason})" if not included
                              else "was written before this node's drain was seen")
                self._events.emit("workers_stopped", f"round {rnd.round} does not include {self.cfg.node_id}",
                                  round=rnd.round)
            self.worker_round = rnd.round
            self._set_state(AgentState.WAITING)
            return
        await self._start_round(rnd)

    async def _end_at_boundary(self, old: LocalRound, new: LocalRound) -> None:
        """Before a planned round replaces ``old``, let the workers that poll for it finish their
        step, save it and exit (:mod:`ftrt.agents.workers.boundary`), for at most a few steps."""
        polling = [w for w in self.pool.running if w.polls_boundary and w.exit_code is None]
        if not polling or not planned_change(old, new):
            return
        intervals = [w.step_interval for w in polling if w.step_interval is not None]
        timeout = boundary_timeout(max(intervals) if intervals else None)
        if self._drain is not None:
            timeout = max(0.0, min(timeout, self._drain.deadline - time.monotonic()))
        t0 = time.monotonic()
        self._round_end.request(old.round, durable=not new.active)
        self.log.info("round %d ends at a step boundary: its workers were asked to save their step and stop "
                      "(waiting up to %.1f s)", old.round, timeout)
        if await self.pool.wait_exited(polling, timeout):
            self.log.info("round %d ended at a step boundary (step %s) in %.0f ms: its workers saved and stopped",
                          old.round, max(w.step for w in polling), (time.monotonic() - t0) * 1000)
        else:
            self.log.warning("round %d: workers did not stop at a step boundary within %.1f s; stopping them",
                             old.round, timeout)

    async def _start_round(self, rnd: LocalRound) -> None:
        t0 = time.monotonic()
        if self.pool.running:
            if self._worker_record is not None:
                await self._end_at_boundary(self._worker_record, rnd)
            await self.pool.stop_running(self.cfg.restart_grace)
        if rnd.first == self.cfg.node_id:
            workers = await self.pool.take()
            try:
                await asyncio.wait_for(workers[0].ready.wait(), self.cfg.worker_start_timeout)
            except asyncio.TimeoutError:
                await self.pool.discard(workers[:1])
                self.pool.give_back(workers[1:])
                await self._request_restart_unassigned(
                    rnd, f"the worker holding the round's store did not start within "
                         f"{self.cfg.worker_start_timeout:g} s (--worker-start-timeout)")
                return
            if workers[0].exit_code is not None:
                self.pool.give_back(workers[1:])
                await self._request_restart_unassigned(rnd, "the worker holding the round's store died")
                return
            try:
                await self.rdzv.publish_master(rnd, self.host, workers[0].store_port)
            except RoundChanged:
                self.pool.give_back(workers)
                return
            except StoreError as exc:  # etcd did not answer: the next pass of the loop tries again
                self.pool.give_back(workers)
                self.log.warning("could not publish round %d's store address (%s); retrying", rnd.round, exc)
                return
            master_addr, master_port = self.host, workers[0].store_port
        else:
            master = await self._wait_master(rnd.round)
            if master is None:
                return
            master_addr, master_port = master.addr, master.port
            workers = await self.pool.take()
        offset = rnd.rank_offset(self.cfg.node_id)
        errors = Path(self.mem_dir) / "errors" / f"round-{rnd.round}"
        errors.mkdir(parents=True, exist_ok=True)
        for local_rank, w in enumerate(workers):
            env = worker_env(
                rnd, node_id=self.cfg.node_id, local_rank=local_rank, job_id=self.cfg.job_id,
                master_addr=master_addr, master_port=master_port,
                max_restarts=self.cfg.max_restarts, agent_addr=self.agent_addr, etcd=self.endpoints,
                etcd_access=self.cfg.etcd_access, mtbf=self.cfg.mtbf,
                checkpoint_key_file=self.cfg.checkpoint_key_file,
                error_file=str(errors / f"rank-{offset + local_rank}.json"),
                nccl_async_error_handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            )
            self.pool.assign(
                w, local_rank=local_rank, rank=offset + local_rank, round_no=rnd.round, env=env,
                script=self.cfg.script, module=self.cfg.module, argv=self.cfg.script_args,
            )
        previous = self._worker_record
        self.worker_round, self._worker_record = rnd.round, rnd
        self._set_state(AgentState.RUNNING)
        self.metrics.round_started(rnd.round, rnd.world_size, rnd.node_count, rnd.reason, first=previous is None,
                                   fault=previous is not None and rnd.faults > previous.faults, written=rnd.created)
        self._events.emit("workers_started", f"ranks {offset}-{offset + len(workers) - 1} of {rnd.world_size} "
                          f"started ({rnd.reason})", ranks=[offset + i for i in range(len(workers))],
                          world_size=rnd.world_size)
        self.log.info(
            "round %d: started ranks %d-%d of %d (%s) in %.0f ms",
            rnd.round, offset, offset + len(workers) - 1, rnd.world_size, rnd.reason,
            (time.monotonic() - t0) * 1000,
        )
        age = time.time() - (rnd.job_started or time.time())
        mtbf = estimate_mtbf(self.cfg.mtbf, rnd.faults, age).seconds
        self.pool.refill_later(SPARE_REFILL_DELAY, idle_grace=idle_warm_grace(change_interval(mtbf, rnd.round, age)))

    async def _request_restart_unassigned(self, rnd: LocalRound, detail: str) -> None:
        self.worker_round = rnd.round
        self._set_state(AgentState.WAITING)
        try:
            await self.rdzv.request_restart(rnd.round, "store", detail)
        except StoreError as exc:
            self.log.warning("could not request a restart: %s", exc)

    async def _wait_master(self, rnd: int):
        """Wait for the round's master record, but give up on stop, fencing or a newer round."""
        seen = self.inbox.version
        while True:
            rec = self.rdzv.masters.get(rnd)
            if rec is not None:
                return rec
            cur = self.rdzv.view.round
            if (
                cur is None or cur.round != rnd or self.rdzv.view.job is not None
                or self.stop.signum is not None or self.membership.expired()
            ):
                return None
            await self.inbox.wait(seen, 0.5)
            seen = self.inbox.version

    def _update_peers(self) -> None:
        """Monitor this node's ring successors and replicate to the first ``--replicas`` of them;
        keep a channel dialled to the next successor too, the one that takes a lost neighbour's
        place (no handshake on the recovery's path)."""
        rnd = self.rdzv.view.round
        used = neighbours(self.cfg)
        try:  # the rendezvous reads the groups of used + 1 successors (see assemble)
            after = rnd.successors(self.cfg.node_id, used + 1) if rnd is not None else []
        except NotLoaded as exc:
            self.log.error("cannot find this node's peers: %s", exc)
            return
        running = self.state is AgentState.RUNNING
        self._monitor.watch({m.node_id: m.agent_addr for m in after[:MONITORED_PEERS] if running and m.agent_addr})
        self.replicator.set_peers([m.agent_addr for m in after[:self.cfg.replicas] if m.agent_addr])
        addrs = [m.agent_addr for m in after if m.agent_addr]
        self._channels.keep(addrs)
        for addr in addrs[used:]:
            self._channels.dial(addr)


async def main(cfg: LaunchConfig, early: EarlyStart | None = None, store: Store | None = None) -> int:
    """Assemble an agent, serve its gRPC service, run it and close everything it built."""
    loop = asyncio.get_running_loop()
    stop = StopSignal(drain=cfg.drain_timeout > 0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.catch, sig)
    try:
        async with contextlib.AsyncExitStack() as stack:
            parts, server = await assemble(cfg, early=early, store=store, stack=stack)
            if stop.signum is not None:
                return 128 + stop.signum
            if stop.drain_asked:  # SIGTERM while starting: nothing to hand over, do not join
                log.info("asked to drain before joining the job; leaving")
                return 0
            agent = Agent(parts, stop)
            await serve(server, AgentServicer(agent, parts.mem_dir, parts.token))
            return await agent.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_agent(cfg: LaunchConfig, early: EarlyStart | None = None) -> int:
    """Run an agent to completion in a fresh event loop; return the exit code."""
    try:
        return asyncio.run(main(cfg, early))
    except FtrtError:
        raise
    except KeyboardInterrupt:
        return 130
