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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid

from ftrt import reports
from ftrt.agents.auth import JobToken, job_token
from ftrt.agents.boundary import RoundEndWriter, boundary_timeout, planned_change
from ftrt.agents.config import LaunchConfig
from ftrt.agents.decide import RendezvousConfig
from ftrt.agents.events import EventLog, open_event_file
from ftrt.agents.fence import FenceWriter
from ftrt.agents.health import find_hung
from ftrt.jobkeys import JobKeys
from ftrt.agents.membership import Taken, register, tcp_refused, update
from ftrt.agents.telemetry import metrics_for
from ftrt.agents.peers import PeerMonitor, ring_successors
from ftrt.records import NodeRecord, RoundRecord
from ftrt.agents.rendezvous import Rendezvous
from ftrt.agents.replicator import Replicator
from ftrt.agents.session import Session
from ftrt.agents.states import AgentState, check_transition
from ftrt.agents.worker_env import worker_env
from ftrt.agents.early import EarlyStart
from ftrt.agents.workers import Worker, WorkerPool, change_interval, idle_warm_grace
from ftrt.checkpoint.cadence import estimate_mtbf
from ftrt.errors import (
    FtrtError,
    LeaseLost,
    NodeIdConflict,
    RoundChanged,
    StoreError,
    StoreUnavailable,
    WorkerFailure,
)
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


class _Prefix(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        a = self.extra["agent"]
        return f"[node={a.cfg.node_id} round={a.worker_round or '-'}] {msg}", kwargs


class Agent:
    """One node's agent. ``await Agent(cfg).run()`` returns the process exit code."""

    def __init__(self, cfg: LaunchConfig, *, store: Store | None = None, early: "EarlyStart | None" = None) -> None:
        self.cfg = cfg
        self._early = early
        self.keys = JobKeys(cfg.job_id)
        self.state = AgentState.STARTING
        self.worker_round = 0
        self.store: Store | None = store
        self.rdzv: Rendezvous | None = None
        self.pool: WorkerPool | None = None
        self.session: Session | None = None
        self.record: NodeRecord | None = None
        self.host = cfg.host or "127.0.0.1"
        self.agent_addr = ""
        self.endpoints = ""
        self.mem_dir = ""
        self.replicator: Replicator | None = None
        self.token: JobToken | None = None
        """The job's token (:mod:`.auth`), read from etcd once connected; state-changing RPCs need it."""
        self.log = _Prefix(log, {"agent": self})
        self._wake = asyncio.Event()
        self._exited: list[Worker] = []
        self._stop_signal: int | None = None
        self._etcd: EtcdServer | None = None
        self._server = None
        self._fence: FenceWriter | None = None
        self._round_end: RoundEndWriter | None = None
        self._worker_record: RoundRecord | None = None  # the round this node's workers run in
        self._run_dir = ""
        self._events: EventLog | None = None
        self._monitor: PeerMonitor | None = None
        self._finished_at = 0.0
        self._background: set[asyncio.Task] = set()
        self.metrics = metrics_for(
            cfg.metrics_port is not None, cfg.node_id, etcd_errors=lambda: getattr(self.store, "errors", 0),
            replicas=lambda: self.replicator.replicated() if self.replicator else None,
        )
        self._metrics_server = None
        self._event_file = None

    # -- state ----------------------------------------------------------------------------------
    def _set_state(self, new: AgentState, why: str = "") -> None:
        if new is self.state:
            return
        check_transition(self.state, new)
        self.log.debug("state %s -> %s %s", self.state.value, new.value, why)
        self.state = new

    def _poke(self) -> None:
        self._wake.set()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- entry ----------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            return await self._run()
        finally:
            await self._shutdown()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        self.log.info("received %s; stopping workers", signal.Signals(sig).name)
        self._stop_signal = sig
        self._poke()

    async def _run(self) -> int:
        cfg = self.cfg
        # Spares first: their torch import is the slow part of joining, so it overlaps with
        # everything else the agent does before it can join. The CLI may have started them already.
        self.host = cfg.host or ("127.0.0.1" if cfg.standalone else detect_host(cfg.etcd or ""))
        early = self._early or EarlyStart.for_config(cfg)
        self._run_dir, self._fence, self.mem_dir = early.run_dir, early.fence, early.mem_dir
        self._round_end = early.round_end
        self.pool = WorkerPool(
            nproc=cfg.nproc_per_node, fence_path=self._fence.path,
            warm=cfg.warm_workers, warm_imports=cfg.warm_imports, base_env=early.base_env,
            log_dir=cfg.log_dir, on_exit=self._on_worker_exit,
            on_memory=lambda rank, step: self.replicator and self.replicator.notify(rank),
            on_heartbeat=lambda w: self.metrics.heartbeat(w.rank, w.round, w.step),
            on_report=self._on_report,
        )
        self.pool.adopt_spares(early.take_spawned())
        template = early.take_template()
        if template is not None:
            self.pool.adopt_template(*template)
        self.pool.fill_spares()
        endpoints = await self._connect()
        self.endpoints = endpoints
        self.token = await job_token(self.store, self.keys)
        self.replicator = Replicator(cfg.node_id, self.mem_dir, self.token, cfg.replica_interval, cfg.agent_tls)
        self.replicator.start()
        from ftrt.agents.service import start_server

        self._server, port = await start_server(self, self.host, cfg.agent_port, cfg.agent_tls)
        self.agent_addr = f"{self.host}:{port}"
        if cfg.metrics_port is not None:
            from ftrt.agents.metrics import serve as serve_metrics

            self._metrics_server, mport = serve_metrics(self.metrics, self.host, cfg.metrics_port)
            self.log.info("Prometheus metrics on http://%s:%d/metrics", self.host, mport)
        if cfg.event_log:
            self._event_file = open_event_file(cfg.event_log)
        self._events = EventLog(self.store, self.keys, cfg.node_id, file=self._event_file,
                                round_of=lambda: self.worker_round)
        await self._join()
        self.rdzv = Rendezvous(
            self.store, self.keys, cfg.node_id,
            RendezvousConfig(
                min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, settle_s=cfg.settle,
                join_settle_s=cfg.join_settle, first_round_wait_s=cfg.first_round_wait,
                join_timeout_s=cfg.join_timeout, max_restarts=cfg.max_restarts,
            ),
            registration=self._registration,
            on_event=lambda kind, msg: self._events.emit(kind, msg),
            on_change=self._poke,
        )
        await self.rdzv.start()
        self._monitor = PeerMonitor(cfg.node_id, self._on_peer_dead, cfg.peer_check_interval, cfg.agent_tls)
        self._set_state(AgentState.WAITING)
        self.log.info(
            "joined job %r as %s (agent %s, %d worker(s), etcd %s)",
            cfg.job_id, cfg.node_id, self.agent_addr, cfg.nproc_per_node, endpoints,
        )
        return await self._loop()

    async def _connect(self) -> str:
        cfg = self.cfg
        if cfg.standalone:
            self._etcd = EtcdServer(name=f"ftrt-{cfg.job_id}", unsafe_no_fsync=True)
            await asyncio.to_thread(self._etcd.start)
            endpoints = self._etcd.endpoint
            self.log.info("standalone: embedded etcd on %s", endpoints)
        else:
            endpoints = cfg.etcd or ""
        if self.store is None:
            self.store = EtcdStore(endpoints, timeout=3.0, access=cfg.etcd_access)
        try:
            await self.store.get(self.keys.root, timeout=5.0)
        except StoreUnavailable as exc:
            raise StoreUnavailable(
                f"Cannot reach etcd at {endpoints} within 5 s. Start etcd there (ftrt etcd), "
                "fix --etcd, or use --standalone for a single-node job."
            ) from exc
        return endpoints

    # -- membership -----------------------------------------------------------------------------
    async def _new_session(self) -> None:
        fence = self._fence
        self.session = Session(self.store, self.cfg.lease_ttl, on_renew=fence.set if fence else None)
        await self.session.start()

    async def _join(self) -> None:
        """Take a lease and register this node (a new incarnation)."""
        await self._new_session()
        cfg = self.cfg
        rec = NodeRecord(
            node_id=cfg.node_id, incarnation=uuid.uuid4().hex[:12], host=self.host,
            agent_addr=self.agent_addr, nproc=cfg.nproc_per_node,
            ready=(not cfg.warm_workers) or self.pool.warm_count >= cfg.nproc_per_node,
            pid=os.getpid(), started=time.time(),
        )
        try:
            self.record = await register(self.store, self.keys, rec, self.session.lease_id)
        except Taken as taken:
            holder = taken.holder
            if holder.pid == os.getpid() and holder.agent_addr == self.agent_addr:
                # Our own earlier registration: a rejoin whose lease we gave up for lost although
                # etcd still holds it. Drop it and register again.
                self.log.warning("node id %s is still held by this agent's previous lease; replacing it",
                                 cfg.node_id)
            elif not await tcp_refused(holder.agent_addr):
                await self.session.close()
                raise NodeIdConflict(
                    f"Node id {cfg.node_id!r} is already held in job {cfg.job_id!r} by a live agent "
                    f"(pid {holder.pid} at {holder.agent_addr}). Give this agent another --node-id."
                ) from None
            else:
                self.log.warning(
                    "node id %s was held by a dead agent (pid %d at %s); taking it over",
                    cfg.node_id, holder.pid, holder.agent_addr,
                )
            await self.store.revoke_lease(holder.lease)
            self.record = await register(self.store, self.keys, rec, self.session.lease_id)
        if not self.record.ready:
            self._spawn(self._announce_ready(self.record.incarnation))

    async def _announce_ready(self, incarnation: str) -> None:
        await self.pool.spares_ready()
        if self.record is None or self.record.incarnation != incarnation or self.record.ready:
            return
        await self._update_record(ready=True)
        self.log.info("warm workers ready after %.2f s", time.monotonic() - self.pool.spares[0].spawned_at
                      if self.pool.spares else 0.0)

    async def _update_record(self, **changes) -> None:
        new = dataclasses.replace(self.record, **changes)
        try:
            await update(self.store, self.keys, new, self.session.lease_id)
            self.record = new
        except (LeaseLost, StoreError) as exc:
            self.log.warning("could not update this node's record: %s", exc)

    def _registration(self) -> tuple[int, str] | None:
        """This node's live lease and incarnation (the rendezvous takes the decider key under it)."""
        if self.session is None or self.record is None or self.session.expired():
            return None
        return self.session.lease_id, self.record.incarnation

    async def _on_peer_dead(self, node_id: str, reason: str) -> None:
        rnd = self.rdzv.view.round if self.rdzv else None
        rec = rnd.member(node_id) if rnd else None
        if rec is None or not rec.lease:
            return
        self.log.warning("peer %s is dead (%s); revoking its lease", node_id, reason)
        self.metrics.fault("node_lost")
        self._events.emit("node_lost", f"{node_id}: {reason}", lost=node_id, evidence=reason)
        try:
            await self.store.revoke_lease(rec.lease, timeout=2.0)
        except StoreError as exc:
            self.log.warning("could not revoke the lease of %s: %s", node_id, exc)

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> int:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._stop_signal is not None:
                self._set_state(AgentState.STOPPED)
                return 128 + self._stop_signal
            if self.session.expired():
                await self._fence_self()
                continue
            job = self.rdzv.view.job
            if job is not None:
                return await self._finish_job(job.state, job.reason)
            await self._handle_exits()
            self._check_hangs()
            if self.state is AgentState.FINISHED:
                if time.monotonic() > self._finished_at + self.cfg.exit_barrier_timeout:
                    self.log.warning("other members did not finish within %.0f s; exiting", self.cfg.exit_barrier_timeout)
                    self._set_state(AgentState.SUCCEEDED)
                    return 0
                continue
            await self._reconcile()
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
        reason = self.session.lost_reason or "the lease ran out before it could be renewed"
        self.log.error("lost membership (%s): stopping workers now", reason)
        self._fence.fence()
        self.pool.kill_running_now()
        await self.pool.stop_running(0.0)
        self.session.orphan()
        self._set_state(AgentState.FENCED)
        self.metrics.fault("fenced")
        self._events.emit("fenced", f"{self.cfg.node_id} fenced itself: {reason}", evidence=reason)
        while True:
            try:
                await self._join()
                break
            except (StoreError, LeaseLost) as exc:
                self.log.warning("rejoining failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
        self._set_state(AgentState.WAITING)
        self.log.info("rejoined as a new member")

    def _on_report(self, worker: Worker, msg: dict) -> None:
        """A worker's checkpoint, restore or trainer report: metrics, and events for the rare ones."""
        self.metrics.report(msg)
        kind = msg.get("t")
        try:
            self._report_event(worker, kind, msg)
        except (TypeError, ValueError):
            self.log.debug("ignored a malformed %s report from rank %s", kind, worker.rank)

    def _report_event(self, worker: Worker, kind, msg: dict) -> None:
        if kind == reports.RESTORE:
            self._events.emit("restore", f"rank {worker.rank} restored step {msg.get('step')} from "
                              f"{msg.get('tier')} in {float(msg.get('seconds', 0)):.2f} s", rank=worker.rank,
                              tier=msg.get("tier"), step=msg.get("step"), seconds=msg.get("seconds"))
        elif kind == reports.CKPT:
            self._events.emit("checkpoint_committed", f"checkpoint step {msg.get('step')} committed to "
                              f"{msg.get('tier')} in {float(msg.get('save_s', 0)):.2f} s", local=True,
                              tier=msg.get("tier"), step=msg.get("step"), seconds=msg.get("save_s"),
                              bytes=msg.get("bytes"))

    def _on_worker_exit(self, worker: Worker) -> None:
        self._exited.append(worker)
        self._poke()

    async def _handle_exits(self) -> None:
        exited, self._exited = self._exited, []
        failed = [w for w in exited if w.round == self.worker_round and w.exit_code != 0]
        if failed and self.state is AgentState.RUNNING:
            w = failed[0]
            detail = f"rank {w.rank} (pid {w.pid}) exited with code {w.exit_code}"
            await self._fail_round("failure", detail)
            return
        running = self.pool.running
        if self.state is AgentState.RUNNING and running and all(w.exit_code == 0 for w in running):
            self.pool.running = []
            self._set_state(AgentState.FINISHED)
            self._finished_at = time.monotonic()
            self.log.info("all workers exited 0 in round %d", self.worker_round)
            self._events.emit("node_done", f"{self.cfg.node_id} finished in round {self.worker_round}")
            await self._update_record(done_round=self.worker_round)

    def _check_hangs(self) -> None:
        if self.state is not AgentState.RUNNING:
            return
        hung = find_hung(
            time.monotonic(),
            [(w.rank, w.last_heartbeat) for w in self.pool.running if w.exit_code is None and not w.done],
            self.cfg.hang_timeout,
        )
        if hung:
            rank, silent = hung[0]
            detail = f"rank {rank} sent no heartbeat for {silent:.1f} s (timeout {self.cfg.hang_timeout:g} s)"
            self._spawn(self._fail_round("hang", detail))

    async def _fail_round(self, kind: str, detail: str) -> None:
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

    async def _reconcile(self) -> None:
        """Make this node's workers match the current round."""
        rnd = self.rdzv.view.round
        if rnd is None or rnd.round == self.worker_round:
            return
        me = rnd.member(self.cfg.node_id)
        included = rnd.active and me is not None and me.incarnation == self.record.incarnation
        if not included:
            if self.pool.running:
                await self.pool.stop_running(self.cfg.restart_grace)
                self.log.info("round %d does not include this node; workers stopped", rnd.round)
                self._events.emit("workers_stopped", f"round {rnd.round} does not include {self.cfg.node_id}",
                                  round=rnd.round)
            self.worker_round = rnd.round
            self._set_state(AgentState.WAITING)
            return
        await self._start_round(rnd)

    async def _end_at_boundary(self, old: RoundRecord, new: RoundRecord) -> None:
        """Before a planned round replaces ``old``, let the workers that poll for it finish their
        step, save it and exit (:mod:`ftrt.agents.boundary`), for at most a few steps."""
        polling = [w for w in self.pool.running if w.polls_boundary and w.exit_code is None]
        if not polling or not planned_change(old, new):
            return
        intervals = [w.step_interval for w in polling if w.step_interval is not None]
        timeout = boundary_timeout(max(intervals) if intervals else None)
        t0 = time.monotonic()
        self._round_end.request(old.round)
        if await self.pool.wait_exited(polling, timeout):
            self.log.info("round %d ended at a step boundary (step %s) in %.0f ms: its workers saved and stopped",
                          old.round, max(w.step for w in polling), (time.monotonic() - t0) * 1000)
        else:
            self.log.warning("round %d: workers did not stop at a step boundary within %.1f s; stopping them",
                             old.round, timeout)

    async def _start_round(self, rnd: RoundRecord) -> None:
        t0 = time.monotonic()
        if self.pool.running:
            if self._worker_record is not None:
                await self._end_at_boundary(self._worker_record, rnd)
            await self.pool.stop_running(self.cfg.restart_grace)
        if rnd.members[0].node_id == self.cfg.node_id:
            workers = await self.pool.take()
            await workers[0].ready.wait()
            if workers[0].exit_code is not None:
                self.pool.spares.extend(w for w in workers[1:] if w.exit_code is None)
                await self._request_restart_unassigned(rnd, "the worker holding the round's store died")
                return
            try:
                await self.rdzv.publish_master(rnd, self.host, workers[0].store_port)
            except RoundChanged:
                self.pool.spares.extend(workers)
                return
            master_addr, master_port = self.host, workers[0].store_port
        else:
            master = await self._wait_master(rnd.round)
            if master is None:
                return
            master_addr, master_port = master.addr, master.port
            workers = await self.pool.take()
        offset = rnd.rank_offset(self.cfg.node_id)
        for local_rank, w in enumerate(workers):
            env = worker_env(
                rnd, node_id=self.cfg.node_id, local_rank=local_rank, job_id=self.cfg.job_id,
                master_addr=master_addr, master_port=master_port,
                max_restarts=self.cfg.max_restarts, agent_addr=self.agent_addr, etcd=self.endpoints,
                etcd_access=self.cfg.etcd_access, mtbf=self.cfg.mtbf,
                checkpoint_key_file=self.cfg.checkpoint_key_file,
            )
            self.pool.assign(
                w, local_rank=local_rank, rank=offset + local_rank, round_no=rnd.round, env=env,
                script=self.cfg.script, module=self.cfg.module, argv=self.cfg.script_args,
            )
        previous = self._worker_record
        self.worker_round, self._worker_record = rnd.round, rnd
        self._set_state(AgentState.RUNNING)
        self.metrics.round_started(rnd.round, rnd.world_size, len(rnd.members), rnd.reason, first=previous is None,
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

    async def _request_restart_unassigned(self, rnd: RoundRecord, detail: str) -> None:
        self.worker_round = rnd.round
        self._set_state(AgentState.WAITING)
        try:
            await self.rdzv.request_restart(rnd.round, "store", detail)
        except StoreError as exc:
            self.log.warning("could not request a restart: %s", exc)

    async def _wait_master(self, rnd: int):
        """Wait for the round's master record, but give up on stop, fencing or a newer round."""
        while True:
            rec = self.rdzv.masters.get(rnd)
            if rec is not None:
                return rec
            cur = self.rdzv.view.round
            if (
                cur is None or cur.round != rnd or self.rdzv.view.job is not None
                or self._stop_signal is not None or self.session.expired()
            ):
                self._poke()
                return None
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    def _update_peers(self) -> None:
        rnd = self.rdzv.view.round
        peers: dict[str, str] = {}
        if rnd is not None and self.state is AgentState.RUNNING:
            for nid in ring_successors(rnd.node_ids, self.cfg.node_id):
                rec = rnd.member(nid)
                if rec is not None and rec.agent_addr:
                    peers[nid] = rec.agent_addr
        self._monitor.watch(peers)
        targets = ring_successors(rnd.node_ids, self.cfg.node_id, k=self.cfg.replicas) if rnd is not None else []
        members = [rnd.member(nid) for nid in targets] if rnd is not None else []
        self.replicator.set_peers([m.agent_addr for m in members if m is not None and m.agent_addr])

    # -- shutdown -------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        if self._monitor is not None:
            await self._monitor.close()
        if self.pool is not None:
            await self.pool.close(self.cfg.stop_grace)
        for task in list(self._background):
            task.cancel()
        if self.rdzv is not None:
            await self.rdzv.close()
        if self._events is not None:
            await self._events.flush()
        if self._event_file is not None:
            self._event_file.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.session is not None:
            await self.session.close()
        if self._server is not None:
            await self._server.stop(0.2)
        if self.store is not None:
            await self.store.close()
        if self._etcd is not None:
            await asyncio.to_thread(self._etcd.stop)
        if self._fence is not None:
            self._fence.close()
        if self._round_end is not None:
            self._round_end.close()
        if self.replicator is not None:
            await self.replicator.close()
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        if self.mem_dir:
            shutil.rmtree(self.mem_dir, ignore_errors=True)


def run_agent(cfg: LaunchConfig, early: EarlyStart | None = None) -> int:
    """Run an agent to completion in a fresh event loop; return the exit code."""
    try:
        return asyncio.run(Agent(cfg, early=early).run())
    except FtrtError:
        raise
    except KeyboardInterrupt:
        return 130

