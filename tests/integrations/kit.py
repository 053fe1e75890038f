"""Scaffolding the trainer integration tests share: one job on two real nodes, a fault on node b."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable

from tests.agents.harness import Node, wait_until


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


def drain_b(nodes: dict[str, Node]) -> None:
    """Node b leaves gracefully, as when Kubernetes deletes its pod (SIGTERM), and exits 0."""
    nodes["b"].proc.send_signal(signal.SIGTERM)
    assert nodes["b"].wait(60) == 0, nodes["b"].log()[-3000:]
