"""Draining a node: SIGTERM, ``ftrt drain`` and preemption notices make an agent leave gracefully.

Real agents on a real etcd, the built-in GRPO trainer (it ends a round at a step boundary and saves
the step in memory), real signals. A drained node exits 0; the job goes on without it from the
step it ended at (nothing redone, no prompt lost or repeated).
"""

from __future__ import annotations

import http.server
import json
import signal
import threading
from pathlib import Path

import pytest

from ftrt.agents.ops.drain import request_drain
from tests.agents.harness import FAST_WARM, Node, wait_until
from tests.checkpoint.test_pointer import latest_record

pytestmark = pytest.mark.slow

STEPS, PROMPTS = 60, 6
CONFIG = [f"steps={STEPS}", f"prompts_per_step={PROMPTS}", "group_size=4", "model.d_model=32", "model.n_layers=1",
          "model.n_heads=2", "checkpoint.interval=1000", "checkpoint.memory_interval=1000", "progress=none"]


def lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def job(tmp: Path, etcd: str, job_id: str, nnodes: str = "1:2", *extra: str) -> list[str]:
    # No checkpoint on the cadence: only the save the round ends with can spare a redo. Departures
    # here are seen at once (a drain says so; a process gone refuses connections): the lease only
    # has to outlast a stalled machine, whose lost lease would be a fault these tests do not expect
    # (a node fenced and rejoined is not in the round, and its drain then ends at once). The long
    # first-round wait makes the first round wait for --nnodes' maximum (it starts once all are ready).
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", nnodes, "--nproc-per-node", "1", "--lease-ttl", "10",
            "--first-round-wait", "120", *FAST_WARM, *extra, "-m", "ftrt.grpo", *CONFIG,
            f"metrics_path={tmp / 'run'}.jsonl", f"checkpoint.url={tmp / 'ck'}"]


def _stepping_at(path: Path, world: int, n: int) -> bool:
    return sum(x["world_size"] == world for x in lines(path)) >= n


def _check_nothing_lost(run: list[dict]) -> None:
    assert [x["step"] for x in run] == list(range(STEPS)), "a step was skipped or repeated"
    ledger = [i for x in run for i in x["prompt_ids"]]
    assert ledger == list(range(STEPS * PROMPTS)), "a prompt was lost or repeated"
    assert run[-1]["redone"] == 0, run[-1]


def _drained(tmp: Path, etcd: str, job_id: str, victim: str, leave, recovery: str = "in-place") -> dict[str, Node]:
    """Two nodes train; ``leave(node)`` makes ``victim`` leave at world 2; the other finishes."""
    nodes = {n: Node(tmp, n, job(tmp, etcd, job_id, "1:2", "--recovery", recovery)).start() for n in ("a", "b")}
    try:
        wait_until(lambda: _stepping_at(tmp / "run.jsonl", 2, 8), 120, "8 steps at world size 2")
        leave(nodes[victim])
        assert nodes[victim].wait(30) == 0, nodes[victim].log()[-3000:]
        survivor = nodes["b" if victim == "a" else "a"]
        assert survivor.wait(180) == 0, survivor.log()[-3000:]
    finally:
        for n in nodes.values():
            n.cleanup()
    return nodes


# a holds rank 0 (and the round's store); in place the survivor's worker goes on, restarted it resumes
@pytest.mark.parametrize("victim,recovery", [("b", "in-place"), ("a", "in-place"), ("a", "restart")])
def test_sigterm_drains_a_node_which_exits_0_and_the_job_goes_on_with_nothing_redone(tmp_path, etcd_endpoint,
                                                                                    job_id, victim, recovery):
    nodes = _drained(tmp_path, etcd_endpoint, job_id, victim, lambda n: n.proc.send_signal(signal.SIGTERM),
                     recovery)
    log = nodes[victim].log()
    assert "draining (SIGTERM)" in log and "drained in" in log, log[-3000:]
    survivor = nodes["b" if victim == "a" else "a"].log()
    said = "kept in place at step" if recovery == "in-place" else "ended at a step boundary"
    assert f"drained {victim}" in survivor and said in survivor, survivor[-3000:]
    run = lines(tmp_path / "run.jsonl")
    _check_nothing_lost(run)
    worlds = [x["world_size"] for x in run]
    assert 2 in worlds and worlds[-1] == 1 and worlds == sorted(worlds, reverse=True), worlds


def test_ftrt_drain_asks_the_node_through_etcd(tmp_path, etcd_endpoint, job_id):
    import asyncio

    said = []

    def leave(node):
        said.append(asyncio.run(request_drain(etcd_endpoint, job_id, node.node_id, reason="maintenance", wait=20)))

    nodes = _drained(tmp_path, etcd_endpoint, job_id, "b", leave)
    assert said and "b left the job" in said[0], said
    assert "draining (ftrt drain: maintenance)" in nodes["b"].log()
    _check_nothing_lost(lines(tmp_path / "run.jsonl"))


class _Notice(http.server.BaseHTTPRequestHandler):
    preempted = False

    def do_GET(self):  # noqa: N802 - the handler's name is fixed
        body = b"TRUE" if _Notice.preempted else b"FALSE"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_preemption_notice_from_a_url_or_a_file_starts_the_same_drain(tmp_path, etcd_endpoint, job_id):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Notice)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/preempted"
    flag = tmp_path / "preempted"
    args = {"a": job(tmp_path, etcd_endpoint, job_id, "1:3", "--preemption-file", str(flag), "--preemption-poll",
                     "0.2"),
            "b": job(tmp_path, etcd_endpoint, job_id, "1:3", "--preemption-url", url, "--preemption-poll", "0.2")}
    args["c"] = job(tmp_path, etcd_endpoint, job_id, "1:3")
    nodes = {n: Node(tmp_path, n, a).start() for n, a in args.items()}
    try:
        wait_until(lambda: _stepping_at(tmp_path / "run.jsonl", 3, 5), 120, "5 steps at world size 3")
        _Notice.preempted = True  # b's cloud says it goes
        assert nodes["b"].wait(30) == 0, nodes["b"].log()[-3000:]
        wait_until(lambda: _stepping_at(tmp_path / "run.jsonl", 2, 5), 60, "5 steps at world size 2")
        flag.touch()  # a's termination handler says it goes
        assert nodes["a"].wait(30) == 0, nodes["a"].log()[-3000:]
        assert nodes["c"].wait(180) == 0, nodes["c"].log()[-3000:]
    finally:
        server.shutdown()
        for n in nodes.values():
            n.cleanup()
    assert f"preemption notice: {url} answered 'TRUE'" in nodes["b"].log()
    assert f"preemption notice: the preemption file {flag} appeared" in nodes["a"].log()
    _check_nothing_lost(lines(tmp_path / "run.jsonl"))


def test_a_second_sigterm_stops_at_once_and_a_drain_past_its_timeout_leaves_as_a_crash(tmp_path, etcd_endpoint,
                                                                                        job_id):
    # A decider that waits 60 s before any new round: no drain can finish. b drains for at most 1 s;
    # c would drain for the default 25 s, but its second SIGTERM ends that.
    slow = ("--settle", "60")
    nodes = {n: Node(tmp_path, n, job(tmp_path, etcd_endpoint, job_id, "1:3", *slow, *extra)).start()
             for n, extra in (("a", ()), ("b", ("--drain-timeout", "1")), ("c", ()))}
    try:
        wait_until(lambda: _stepping_at(tmp_path / "run.jsonl", 3, 3), 120, "3 steps at world size 3")
        nodes["b"].proc.send_signal(signal.SIGTERM)
        assert nodes["b"].wait(20) == 128 + signal.SIGTERM, nodes["b"].log()[-3000:]
        assert "did not finish within 1 s (--drain-timeout); leaving as a crash would" in nodes["b"].log()
        nodes["c"].proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "draining (SIGTERM)" in nodes["c"].log(), 10, "c to start draining")
        nodes["c"].proc.send_signal(signal.SIGTERM)  # the second one: no waiting for the drain
        # before its 25 s drain timeout could end it
        assert nodes["c"].wait(20) == 128 + signal.SIGTERM, nodes["c"].log()[-3000:]
        assert "drained in" not in nodes["c"].log()
    finally:
        for n in nodes.values():
            n.cleanup()


def test_a_drain_below_min_says_so_and_the_job_waits_for_a_newcomer(tmp_path, etcd_endpoint, job_id):
    nodes = {n: Node(tmp_path, n, job(tmp_path, etcd_endpoint, job_id, "2:2")).start() for n in ("a", "b")}
    try:
        wait_until(lambda: _stepping_at(tmp_path / "run.jsonl", 2, 6), 120, "6 steps at world size 2")
        nodes["b"].proc.send_signal(signal.SIGTERM)
        assert nodes["b"].wait(30) == 0, nodes["b"].log()[-3000:]
        assert "below its minimum of 2 nodes: it waits for a newcomer" in nodes["b"].log()
        wait_until(lambda: "waiting for a newcomer" in nodes["a"].log(), 10, "a's round to say it waits")
        assert nodes["a"].alive() and "workers stopped" in nodes["a"].log()  # waiting, not training
        # The job waits with no round: the step it ended at went to storage too (memory may leave with
        # the nodes), committed though the round had ended.
        trained = len(lines(tmp_path / "run.jsonl"))
        assert latest_record(etcd_endpoint, job_id)["step"] == trained
        nodes["c"] = Node(tmp_path, "c", job(tmp_path, etcd_endpoint, job_id, "2:2")).start()
        assert nodes["a"].wait(180) == 0, nodes["a"].log()[-3000:]
        assert nodes["c"].wait(60) == 0, nodes["c"].log()[-3000:]
    finally:
        for n in nodes.values():
            n.cleanup()
    _check_nothing_lost(lines(tmp_path / "run.jsonl"))
