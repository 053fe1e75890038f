"""The agent's Prometheus metrics: what each event does to them (an injected clock), and the
exposition a scrape returns over real HTTP."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ftrt import reports
from ftrt.agents.ops.metrics import AgentMetrics, restart_reason, serve


def wire(m, message: dict) -> None:
    """Feed ``message`` as the agent does: decoded from its JSON line; what does not decode (junk, a
    type or field this version does not know) never reaches the metrics."""
    report = reports.decode(json.dumps(message))
    if report is not None:
        m.report(report)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sample(m: AgentMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels or None)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def m(clock) -> AgentMetrics:
    return AgentMetrics("n0", etcd_errors=lambda: 7, replicas=lambda: {0: 10}, clock=clock)


def test_round_reasons_map_to_restart_labels():
    assert restart_reason("lost n2") == "node_lost"
    assert restart_reason("worker failure on n1: failure (rank 1 (pid 9) exited with code 1)") == "worker_failure"
    assert restart_reason("worker failure on n1: hang (rank 1 sent no heartbeat for 61 s)") == "worker_hang"
    assert restart_reason("admitted n3") == "node_joined"
    assert restart_reason("back to 2 nodes") == "quorum_regained"


def test_recovery_runs_from_the_first_evidence_to_the_first_step_of_the_new_round(m, clock):
    m.round_started(1, 3, 3, "first round with 3 nodes", first=True, fault=False)
    m.heartbeat(0, 1, 1)
    assert sample(m, "ftrt_restarts_total", reason="node_lost") == 0  # the series exists before any restart
    clock.t = 200.0
    m.fault("node_lost")
    clock.t = 200.4
    m.fault("node_lost")  # a second sign of the same fault does not move the start
    clock.t = 200.6
    m.round_started(2, 2, 2, "lost n2", first=False, fault=True)
    m.heartbeat(0, 1, 5)  # a late beat of the old round's worker does not end the recovery
    clock.t = 201.5
    m.heartbeat(0, 2, 5)
    clock.t = 201.9
    m.heartbeat(1, 2, 5)  # only the first step after the fault counts
    assert sample(m, "ftrt_recovery_seconds_count") == 1
    assert sample(m, "ftrt_recovery_seconds_sum") == pytest.approx(1.5)
    assert sample(m, "ftrt_restarts_total", reason="node_lost") == 1
    assert sample(m, "ftrt_faults_detected_total", kind="node_lost") == 2
    assert (sample(m, "ftrt_round"), sample(m, "ftrt_world_size"), sample(m, "ftrt_nodes")) == (2, 2, 2)
    clock.t = 300.0
    m.round_started(3, 3, 3, "admitted n2", first=False, fault=False)  # a join is no fault
    m.heartbeat(0, 3, 9)
    assert sample(m, "ftrt_recovery_seconds_count") == 1
    assert sample(m, "ftrt_restarts_total", reason="node_joined") == 1


def test_without_local_evidence_the_rounds_writing_marks_the_fault(clock):
    m = AgentMetrics("n0", etcd_errors=lambda: 0, replicas=lambda: None, clock=clock, wall=lambda: 5000.0)
    m.round_started(1, 2, 2, "first", first=True, fault=False)
    clock.t = 10.0  # the workers start 0.3 s after the round was written (stop, master, assignment)
    m.round_started(2, 1, 1, "lost n1", first=False, fault=True, written=4999.7)
    clock.t = 10.8
    m.heartbeat(0, 2, 3)
    assert sample(m, "ftrt_recovery_seconds_sum") == pytest.approx(1.1)
    assert sample(m, "ftrt_replica_lag_steps") is None  # no peer, no lag


def test_goodput_counts_progress_only(m, clock):
    m.round_started(1, 1, 1, "first", first=True, fault=False)
    for step in range(1, 11):  # 10 steps of 1 s
        m.heartbeat(0, 1, step)
        clock.t += 1.0
    clock.t += 20.0  # a 20 s stall
    m.round_started(2, 1, 1, "worker failure on n0: failure (x)", first=False, fault=True)
    for step in range(8, 16):  # restored at step 7: steps 8-10 are redone, 11-15 are new
        m.heartbeat(0, 2, step)
        clock.t += 1.0
    # productive: steps 2-10 (9 s; the first beat has no interval) + 11-15 (5 s); wall: 10 + 20 + 8 s
    assert m.goodput() == pytest.approx(14.0 / 38.0)
    assert sample(m, "ftrt_step_seconds_count") == 9 + 7


def test_reports_fill_the_checkpoint_and_trainer_metrics_and_junk_is_ignored(m):
    wire(m, {"t": "mem", "rank": 0, "step": 12, "bytes": 1000, "save_s": 0.01})
    wire(m, {"t": "ckpt", "tier": "storage", "rank": 0, "step": 10, "bytes": 5000, "save_s": 0.4})
    wire(m, {"t": "restore", "rank": 0, "tier": "memory", "step": 12, "seconds": 0.2})
    wire(m, {"t": "stats", "values": {"reward_mean": 0.5, "Bad-Name": 1, "x" * 60: 2}})
    wire(m, {"t": "ckpt", "tier": "../etc", "step": 1})
    wire(m, {"t": "ckpt", "tier": "storage", "step": "soon"})
    wire(m, {"t": "stats", "values": {"kl": "high"}})
    assert sample(m, "ftrt_checkpoint_last_step", tier="memory") == 12
    assert sample(m, "ftrt_checkpoint_bytes", tier="storage") == 5000
    assert sample(m, "ftrt_checkpoint_last_step", tier="storage") == 10
    assert sample(m, "ftrt_checkpoint_restore_seconds_sum", tier="memory") == pytest.approx(0.2)
    assert sample(m, "ftrt_trainer_reward_mean") == 0.5
    assert sample(m, "ftrt_replica_lag_steps") == 2  # memory step 12, the peer holds step 10
    assert sample(m, "ftrt_etcd_errors_total") == 7
    samples = [x for family in m.registry.collect() for x in family.samples]
    assert not any("Bad" in x.name or "xxxx" in x.name or x.labels.get("tier") == "../etc" for x in samples)


def test_a_scrape_over_http_returns_the_exposition(m):
    m.round_started(4, 2, 2, "lost n1", first=False, fault=True)
    m.heartbeat(1, 4, 33)
    server, port = serve(m, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    assert "ftrt_round 4.0" in text and 'ftrt_worker_step{rank="1"} 33.0' in text
    assert 'ftrt_restarts_total{reason="node_lost"} 1.0' in text and "ftrt_recovery_seconds_bucket" in text


def test_every_metric_is_documented_and_the_dashboard_names_only_real_ones(m, clock):
    import re
    from pathlib import Path

    docs = Path(__file__).parents[2] / "docs"
    wire(m, {"t": "mem", "rank": 0, "step": 1, "bytes": 1, "save_s": 0.1})
    wire(m, {"t": "stats", "values": {"reward_mean": 1.0, "kl": 0.0, "tokens_per_second": 5.0}})
    wire(m, {"t": "restore", "rank": 0, "tier": "storage", "step": 1, "seconds": 0.5})
    m.round_started(1, 1, 1, "first", first=True, fault=False)
    m.heartbeat(0, 1, 1)  # every series that needs data has some
    clock.t += 1.0
    families = {f.name: f for f in m.registry.collect()}
    page = (docs / "metrics.md").read_text()
    for name, family in families.items():
        shown = name + "_total" if family.type == "counter" else name
        if not name.startswith("ftrt_trainer_"):
            assert f"`{shown}" in page, f"{shown} is not documented in docs/metrics.md"
    samples = {s.name for f in families.values() for s in f.samples}
    dashboard = json.loads((docs / "grafana-ftrt.json").read_text())
    used = {n for p in dashboard["panels"] for t in p["targets"] for n in re.findall(r"ftrt_\w+", t["expr"])}
    assert used and used <= samples, used - samples


def test_a_kept_worker_s_beats_count_for_the_round_it_took_not_the_one_only_handed_to_it():
    """In place the agent hands a worker its next round before the worker takes it; a beat of the
    step it finished in the old round must not end the new round's recovery."""
    from types import SimpleNamespace

    from ftrt.agents.workers.pool import Worker

    w = Worker(proc=SimpleNamespace(pid=1))  # type: ignore[arg-type]
    w.round = w.taken_round = 2
    w.round = 3  # handed over (WorkerPool.hand_round), not taken yet
    w.heard(reports.Heartbeat(7))
    assert w.taken_round == 2
    w.heard(reports.Reconfigured(3))
    assert w.taken_round == 3 and w.took_round.is_set()
