"""Prometheus metrics of one agent and its workers (``ftrt launch --metrics-port P``).

Each agent serves ``/metrics`` for its node, on ``--host``'s address (never every interface), from
a registry of its own. What the agent sees happen (rounds, restarts, faults, checkpoint reports,
heartbeats) updates the metrics as it happens, each update a few dict writes; values that are a
function of the time (heartbeat age, replica lag, goodput) are computed when Prometheus scrapes.
docs/metrics.md lists every metric; docs/grafana-ftrt.json is a dashboard for them.

Recovery time (``ftrt_recovery_seconds``) runs from the first evidence of a fault this node has
(a peer's stream broke, a worker exited or hung; else the time the new round was written) to
the first step any of this node's workers completes in the round that replaced it.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ftrt import reports


RESTART_REASONS = ("node_lost", "worker_failure", "worker_hang", "node_joined", "quorum_regained", "other")
FAULT_KINDS = ("node_lost", "worker_failure", "worker_hang", "fenced")
RECOVERY_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
TRAINER_NAME = re.compile(r"[a-z][a-z0-9_]{0,47}")
MAX_TRAINER_METRICS = 32
"""Names a worker may report with ``rt.report_metrics`` (each becomes ``ftrt_trainer_<name>``)."""
TIERS = ("memory", "storage")


def restart_reason(round_reason: str) -> str:
    """The ``reason`` label of a round change, from the round's reason text (:mod:`.decide`)."""
    if round_reason.startswith("lost "):
        return "node_lost"
    if round_reason.startswith("worker failure"):
        return "worker_hang" if ": hang (" in round_reason else "worker_failure"
    if round_reason.startswith("admitted "):
        return "node_joined"
    if round_reason.startswith("back to "):
        return "quorum_regained"
    return "other"


class AgentMetrics:
    """The metrics of one node. ``etcd_errors``, ``replicas`` (rank -> step last copied to
    the peer; None while the node has no peer) and ``replicas_refused`` (replicas from peers this
    node refused, :mod:`ftrt.agents.peers.claims`) are read at scrape time."""

    def __init__(self, node_id: str, *, etcd_errors: Callable[[], int],
                 replicas: Callable[[], dict[int, int] | None], replicas_refused: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.clock = clock
        self.wall = wall
        self.registry = CollectorRegistry()
        r = self.registry
        self.round = Gauge("ftrt_round", "The rendezvous round this node's workers run in.", registry=r)
        self.world_size = Gauge("ftrt_world_size", "Workers in the current round, all nodes together.", registry=r)
        self.nodes = Gauge("ftrt_nodes", "Nodes in the current round.", registry=r)
        self.restarts = Counter("ftrt_restarts", "Round changes that restarted this node's workers, by cause.",
                                ["reason"], registry=r)
        self.recoveries = Counter("ftrt_recoveries", "Round changes after the first on this node, by how its "
                                  "workers took them (in-place: the live ones kept their processes; restart: "
                                  "every one replaced).", ["mode"], registry=r)
        self.faults = Counter("ftrt_faults_detected", "Faults this node saw evidence of, by kind.", ["kind"],
                              registry=r)
        self.recovery = Histogram("ftrt_recovery_seconds", "From a fault's first evidence to the first step "
                                  "after it, on this node.", buckets=RECOVERY_BUCKETS, registry=r)
        self.step_seconds = Histogram("ftrt_step_seconds", "Wall time of a training step (between two "
                                      "heartbeats of a worker).", buckets=STEP_BUCKETS, registry=r)
        self.save_seconds = Histogram("ftrt_checkpoint_save_seconds", "Wall time of a checkpoint save, by tier "
                                      "(memory: staging; storage: until committed).", ["tier"],
                                      buckets=SAVE_BUCKETS, registry=r)
        self.restore_seconds = Histogram("ftrt_checkpoint_restore_seconds", "Wall time of a restore, by tier.",
                                         ["tier"], buckets=SAVE_BUCKETS, registry=r)
        self.ckpt_bytes = Gauge("ftrt_checkpoint_bytes", "Bytes of this node's newest checkpoint, by tier.",
                                ["tier"], registry=r)
        self.ckpt_step = Gauge("ftrt_checkpoint_last_step", "Step of this node's newest checkpoint, by tier.",
                               ["tier"], registry=r)
        for reason in RESTART_REASONS:  # every series exists from the start, at 0, for rate() and alerts
            self.restarts.labels(reason)
        for kind in FAULT_KINDS:
            self.faults.labels(kind)
        for mode in ("in-place", "restart"):
            self.recoveries.labels(mode)
        self._trainer: dict[str, Gauge] = {}
        self._lock = threading.Lock()  # the scrape runs on the HTTP server's thread
        self._steps: dict[int, tuple[int, float]] = {}  # rank -> (step, monotonic time of its heartbeat)
        self._mem_steps: dict[int, int] = {}
        self._fault_at: float | None = None  # first evidence of a fault not yet recovered from
        self._recovering_round = 0
        self._high_water = -1  # the newest step any worker of this node completed: only progress beyond it counts
        self._productive = 0.0
        self._first_step_at: float | None = None
        self._typical = 0.0  # smoothed step time
        r.register(_Live(self, etcd_errors, replicas, replicas_refused))

    # -- events ---------------------------------------------------------------------------------
    def fault(self, kind: str) -> None:
        """Evidence of a fault: ``node_lost``, ``worker_failure``, ``worker_hang``, ``fenced``."""
        self.faults.labels(kind).inc()
        if self._fault_at is None:
            self._fault_at = self.clock()

    def round_started(self, round_no: int, world_size: int, nodes: int, reason: str, *, first: bool,
                      fault: bool, written: float = 0.0, mode: str = "restart") -> None:
        """This node's workers start in a new round (``first``: the job's first for this node;
        ``written``: the wall time the round was written, the fault's mark without local evidence;
        ``mode``: ``in-place`` when live workers took it without exiting, else ``restart``)."""
        self.round.set(round_no)
        self.world_size.set(world_size)
        self.nodes.set(nodes)
        if not first:
            self.restarts.labels(restart_reason(reason)).inc()
            self.recoveries.labels(mode).inc()
        if fault:
            self._recovering_round = round_no
            if self._fault_at is None:  # no local evidence: the round's writing is the first sign here
                self._fault_at = self.clock() - max(0.0, self.wall() - written) if written else self.clock()
        else:
            self._fault_at = None
        with self._lock:
            self._steps.clear()

    def heartbeat(self, rank: int, round_no: int, step: int) -> None:
        """A worker completed ``step``."""
        now = self.clock()
        if self._recovering_round and round_no >= self._recovering_round and self._fault_at is not None:
            self.recovery.observe(now - self._fault_at)
            self._fault_at, self._recovering_round = None, 0
        with self._lock:
            before = self._steps.get(rank)
            self._steps[rank] = (step, now)
        if before is None or step <= before[0]:
            if self._first_step_at is None:
                self._first_step_at = now
            self._high_water = max(self._high_water, step)
            return
        per_step = (now - before[1]) / (step - before[0])
        self.step_seconds.observe(per_step)
        if step > self._high_water:  # new progress; steps redone after a restore do not count
            typical = self._typical or per_step
            self._productive += min(per_step, 3 * typical) * (step - max(self._high_water, before[0]))
            self._typical = 0.9 * typical + 0.1 * min(per_step, 3 * typical)
            self._high_water = step

    def report(self, report: reports.Report) -> None:
        """A worker's checkpoint or trainer report (:mod:`ftrt.reports`; others are not counted here)."""
        match report:
            case reports.MemorySaved(rank=rank, step=step):
                self._mem_steps[rank] = step
                self._saved("memory", step, report.bytes, report.save_s)
            case reports.Committed(tier=tier, step=step) if tier in TIERS:
                self._saved(tier, step, report.bytes, report.save_s)
            case reports.Restored(tier=tier, seconds=seconds) if tier in TIERS:
                self.restore_seconds.labels(tier).observe(seconds)
            case reports.Stats(values=values):
                for name, value in values.items():
                    if self._trainer_ok(name):
                        self._trainer_gauge(name).set(value)

    def _saved(self, tier: str, step: int, size: int, save_s: float) -> None:
        self.save_seconds.labels(tier).observe(save_s)
        self.ckpt_bytes.labels(tier).set(float(size))
        self.ckpt_step.labels(tier).set(step)

    def _trainer_ok(self, name) -> bool:
        return isinstance(name, str) and TRAINER_NAME.fullmatch(name) is not None and (
            name in self._trainer or len(self._trainer) < MAX_TRAINER_METRICS)

    def _trainer_gauge(self, name: str) -> Gauge:
        if name not in self._trainer:
            self._trainer[name] = Gauge(f"ftrt_trainer_{name}", f"The trainer's {name!r}, as its rank 0 last "
                                        "reported it (rt.report_metrics).", registry=self.registry)
        return self._trainer[name]

    # -- scrape-time values ---------------------------------------------------------------------
    def goodput(self) -> float | None:
        """Training time that moved the job forward over wall time since this node's first step."""
        if self._first_step_at is None:
            return None
        wall = self.clock() - self._first_step_at
        return min(1.0, self._productive / wall) if wall > 0 else None

    def live_steps(self) -> dict[int, tuple[int, float]]:
        with self._lock:
            return dict(self._steps)


class _Live(Collector):
    """Metrics computed when scraped."""

    def __init__(self, m: AgentMetrics, etcd_errors: Callable[[], int],
                 replicas: Callable[[], dict[int, int] | None], replicas_refused: Callable[[], int]):
        self.m, self.etcd_errors, self.replicas, self.replicas_refused = m, etcd_errors, replicas, replicas_refused

    def collect(self) -> Iterable:
        now = self.m.clock()
        steps = GaugeMetricFamily("ftrt_worker_step", "The step each of this node's workers last completed.",
                                  labels=["rank"])
        age = GaugeMetricFamily("ftrt_heartbeat_age_seconds", "Seconds since each worker's last heartbeat.",
                                labels=["rank"])
        for rank, (step, at) in sorted(self.m.live_steps().items()):
            steps.add_metric([str(rank)], step)
            age.add_metric([str(rank)], now - at)
        yield steps
        yield age
        lag = GaugeMetricFamily("ftrt_replica_lag_steps", "Steps this node's newest memory checkpoint is ahead "
                                "of its copies on its replica peers (largest over its ranks and peers).")
        sent = self.replicas()
        saved = dict(self.m._mem_steps)
        if saved and sent is not None:
            lag.add_metric([], max(step - sent.get(rank, -1) if sent.get(rank, -1) >= 0 else step + 1
                                   for rank, step in saved.items()))
        yield lag
        good = self.m.goodput()
        ratio = GaugeMetricFamily("ftrt_goodput_ratio", "Share of wall time since this node's first step spent "
                                  "on steps that moved training forward (stalls and redone steps excluded).")
        if good is not None:
            ratio.add_metric([], good)
        yield ratio
        errors = CounterMetricFamily("ftrt_etcd_errors", "Failed etcd call attempts (retried or not).")
        errors.add_metric([], self.etcd_errors())
        yield errors
        refused = CounterMetricFamily("ftrt_replicas_refused", "Memory replicas from peers this node refused: "
                                      "not what their owner claimed, or sent by another node.")
        refused.add_metric([], self.replicas_refused())
        yield refused


def serve(metrics: AgentMetrics, host: str, port: int):
    """Serve ``/metrics`` on ``host:port`` in a daemon thread; return the server (``.shutdown()``)
    and the port it listens on (``port`` 0 picks one)."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, server.server_address[1]
