"""Observing a job: Prometheus metrics, the event file and ``ftrt status --watch`` while a node
is lost (real etcd, real agents and workers, a real scrape over HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftrt.store.etcd_server import free_port
from tests.agents.harness import FAST_WARM, Node, kill_at_rest, wait_until

WORKER = Path(__file__).parents[1] / "checkpoint" / "tier_worker.py"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_a_node_loss_shows_in_the_metrics_the_event_file_and_status_watch(tmp_path, etcd_endpoint, job_id):
    log = tmp_path / "steps.jsonl"
    ports = {"a": free_port(), "b": free_port()}
    common = ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1:2", "--lease-ttl", "2",
              "--first-round-wait", "1", *FAST_WARM]
    script = [str(WORKER), str(tmp_path / "ck"), str(log), "400", str(tmp_path / "hold")]
    nodes = {n: Node(tmp_path, n, [*common, "--metrics-port", str(ports[n]), "--event-log",
                                   str(tmp_path / f"events-{n}.jsonl"), *script]).start() for n in ("a", "b")}
    watch = subprocess.Popen([sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", etcd_endpoint, "--job-id",
                              job_id, "--watch", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        steps = lambda: [e for e in lines(log) if e.get("event") == "step"]  # noqa: E731
        wait_until(lambda: any(e["world"] == 2 and e["step"] >= 20 for e in steps()), 90, "2 nodes training")
        before = scrape(ports["a"])
        assert before[("ftrt_world_size", ())] == 2 and before[("ftrt_nodes", ())] == 2
        assert before[("ftrt_restarts_total", (("reason", "node_lost"),))] == 0
        killed_at = kill_at_rest(nodes["b"], nodes["a"], tmp_path / "hold", lambda: max(e["step"] for e in steps()))
        first = wait_until(lambda: next((e for e in steps() if e["world"] == 1 and e["time"] > killed_at), None),
                           60, "the survivor's first step alone")
        measured = first["time"] - killed_at
        after = wait_until(lambda: (m := scrape(ports["a"]))[("ftrt_recovery_seconds_count", ())] >= 1 and m, 10,
                           "the recovery in the metrics")
        assert after[("ftrt_restarts_total", (("reason", "node_lost"),))] == 1
        assert after[("ftrt_round", ())] > before[("ftrt_round", ())] and after[("ftrt_world_size", ())] == 1
        recovery = after[("ftrt_recovery_seconds_sum", ())] / after[("ftrt_recovery_seconds_count", ())]
        assert abs(recovery - measured) <= 0.5 + 0.25 * measured, (recovery, measured)
        assert after[("ftrt_checkpoint_restore_seconds_count", (("tier", "memory"),))] >= 1
        assert after[("ftrt_heartbeat_age_seconds", (("rank", "0"),))] < 5
        assert nodes["a"].wait(120) == 0, nodes["a"].log()
        out, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
        for n in nodes.values():
            n.cleanup()
    events = lines(tmp_path / "events-a.jsonl")
    kinds = [e["kind"] for e in events]
    assert {"workers_started", "restore", "round"} <= set(kinds), kinds
    assert all({"time", "node", "round", "kind", "message"} <= set(e) for e in events)
    restore = next(e for e in events if e["kind"] == "restore" and e["time"] > killed_at)
    assert restore["tier"] == "memory" and restore["seconds"] >= 0
    lost = [e for e in events if e["kind"] == "node_lost"]
    assert lost and lost[0]["lost"] == "b" and lost[0]["evidence"], kinds  # a's peer monitor saw b's stream break
    assert any(e["kind"] == "round" and "lost b" in e["message"] for e in events)
    followed = [json.loads(x) for x in out.splitlines()]
    assert followed[0]["job_id"] == job_id  # the status first, then what happened
    assert any("round" in x and x["round"]["reason"] == "lost b" for x in followed[1:]), out[-3000:]
    assert any(x.get("event", {}).get("kind") == "restore" for x in followed[1:])
    assert followed[-1] == {"job": followed[-1]["job"]} and followed[-1]["job"]["state"] == "succeeded", err
