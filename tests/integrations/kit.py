"""Scaffolding the trainer integration tests share: one job on two real nodes, a fault on node b.

Jobs for :func:`two_nodes` should start with ``--nnodes 1:2`` and a long ``--first-round-wait``
(:data:`BOTH_IN_ROUND_1`): the first round then waits for both nodes (it starts as soon as both are
ready), so steps at world size 2 begin with step 1 on any machine.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

from ftrt.chaos.local import worker_pids
from tests.agents.harness import Node, wait_until

BOTH_IN_ROUND_1 = ("--first-round-wait", "120")
"""Launch flags for a job of ``--nnodes 1:2`` whose first round waits for its second node."""


def reference_run(tmp_path_factory, etcd: str, name: str, args: Callable[[Path, str, str], list[str]],
                  losses: Callable[[Path], dict], steps: int) -> tuple[Path, dict]:
    """The uninterrupted run a trainer's fault tests compare with: one node ``ref`` of job
    ``<name>-ref`` launched with ``args(folder, etcd, job_id)``; its folder and its losses by step
    (``losses(folder / "ref.jsonl")``), checked to cover steps 1 to ``steps``."""
    tmp = tmp_path_factory.mktemp(f"{name}-ref")
    node = Node(tmp, "ref", args(tmp, etcd, f"{name}-ref")).start()
    try:
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    got = losses(tmp / "ref.jsonl")
    assert sorted(got) == list(range(1, steps + 1))
    return tmp, got


def two_nodes(tmp: Path, args: list[str], ready: Callable[[], object], what: str,
              fault: Callable[[dict[str, Node]], None]) -> dict[str, Node]:
    """Nodes ``a`` and ``b`` run one job; once ``ready()`` holds, ``fault(nodes)`` acts on them and
    node ``a`` must finish the job (exit 0). Both are cleaned up; their logs stay readable."""
    nodes = {n: Node(tmp, n, args).start() for n in ("a", "b")}
    try:
        wait_until(ready, 180, what)
        fault(nodes)
        assert nodes["a"].wait(240) == 0, nodes["a"].log()[-3000:]
    finally:
        for n in nodes.values():
            n.cleanup()
    return nodes


def kill_b(nodes: dict[str, Node]) -> None:
    """Node b is lost (its agent and workers SIGKILLed)."""
    nodes["b"].kill()


ROUND_END_ASKED = "ends at a step boundary: its workers were asked to save"
"""What an agent logs when it asks its workers to end their round at a step boundary."""


def drain_b(nodes: dict[str, Node]) -> None:
    """Node b leaves gracefully, as when Kubernetes deletes its pod (SIGTERM), and exits 0.

    The job's workers are held still (SIGSTOP) from just before the signal until node a's agent has
    asked them to end their round, so the drain surely lands while the job has steps left to end
    the round at, however slow the machine."""
    etcd, job_id = _job_of(nodes["a"])
    workers = list(worker_pids(etcd, job_id).values())
    asked = nodes["a"].log().count(ROUND_END_ASKED)
    _signal_all(workers, signal.SIGSTOP)
    try:
        nodes["b"].proc.send_signal(signal.SIGTERM)
        wait_until(lambda: nodes["a"].log().count(ROUND_END_ASKED) > asked, 60, "a's round to be asked to end")
    finally:
        _signal_all(workers, signal.SIGCONT)
    assert nodes["b"].wait(60) == 0, nodes["b"].log()[-3000:]


def _job_of(node: Node) -> tuple[str, str]:
    args = node.launch_args
    return args[args.index("--etcd") + 1], args[args.index("--job-id") + 1]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
