"""Health probes: the pure judgement, and real agents answering grpc.health.v1 and HTTP."""

from __future__ import annotations

import re
import signal
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftrt.agents.ops.probes import LIVENESS, judge
from ftrt.agents.states import AgentState
from tests.agents.harness import Node, Progress, ddp_args, wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _judge(state: AgentState, **kw):
    args = dict(registered=True, expired=False, in_round=True, current_round=3)
    return judge(state, **{**args, **kw})


def test_ready_means_live_and_running_in_the_current_round():
    p = _judge(AgentState.RUNNING)
    assert p.live and p.ready and "round 3" in p.detail
    spare = _judge(AgentState.WAITING, in_round=False)
    assert spare.live and not spare.ready and "waiting for a round" in spare.detail
    assert not _judge(AgentState.RUNNING, in_round=False).ready  # the round moved on without it
    assert not _judge(AgentState.WAITING).ready  # its workers are starting
    leaving = _judge(AgentState.DRAINING)
    assert leaving.live and not leaving.ready and "draining" in leaving.detail


def test_without_a_session_an_agent_is_live_but_not_ready_and_stopping_it_is_neither():
    for probe in (_judge(AgentState.RUNNING, expired=True), _judge(AgentState.STARTING, registered=False),
                  _judge(AgentState.FENCED)):
        assert probe.live and not probe.ready  # an etcd outage must not get every pod restarted
    assert "fenced" in _judge(AgentState.FENCED).detail
    for state in (AgentState.STOPPED, AgentState.FAILED, AgentState.SUCCEEDED):
        assert not _judge(state).live and not _judge(state).ready


def _check(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=2).status


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
def test_agents_answer_grpc_health_and_http_probes_through_a_drain(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=100000)
    nodes = {n: make_node(n, script, nnodes="1:1", extra=("--health-port", "0")) for n in ("a", "b")}

    def endpoints(node: Node) -> tuple[str, str]:
        log = node.log()
        grpc_addr = re.search(r"\(agent (\S+), ", log).group(1)
        http_base = re.search(r"health probes on (http://\S+)/healthz", log).group(1)
        return grpc_addr, http_base

    wait_until(lambda: progress.stepping(world=1, ranks=1), 60, "stepping")
    wait_until(lambda: all("(agent " in n.log() for n in nodes.values()), 30, "both agents joined")
    running = next(n for n in nodes.values() if "started ranks" in n.log())
    spare = next(n for n in nodes.values() if n is not running)
    (g_run, h_run), (g_spare, h_spare) = endpoints(running), endpoints(spare)
    wait_until(lambda: _check(g_run, "") == SERVING, 10, "the running node to be ready")
    assert _check(g_run, LIVENESS) == SERVING and _http(f"{h_run}/readyz")[0] == 200
    assert _check(g_spare, LIVENESS) == SERVING and _http(f"{h_spare}/healthz")[0] == 200  # alive...
    status, body = _http(f"{h_spare}/readyz")
    assert _check(g_spare, "") == NOT_SERVING and status == 503 and "waiting for a round" in body  # ...not ready
    assert _http(f"{h_spare}/nothing")[0] == 404

    running.proc.send_signal(signal.SIGTERM)  # drains: the spare takes its place
    wait_until(lambda: _check(g_spare, "") == SERVING, 30, "the spare to be ready in the new round")
    assert running.wait(30) == 0, running.log()[-3000:]
