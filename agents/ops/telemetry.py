"""The agent's metrics sink: Prometheus (:mod:`.metrics`) when ``--metrics-port`` is given, else
one that does nothing, so that an agent without it never imports ``prometheus_client`` (~0.1 s
of its start-up here)."""

from __future__ import annotations

from typing import Callable, Protocol


class Metrics(Protocol):
    """What the agent tells its metrics (see :class:`ftrt.agents.ops.metrics.AgentMetrics`)."""

    def fault(self, kind: str) -> None: ...

    def round_started(self, round_no: int, world_size: int, nodes: int, reason: str, *, first: bool,
                      fault: bool, written: float = 0.0, mode: str = "restart") -> None: ...

    def heartbeat(self, rank: int, round_no: int, step: int) -> None: ...

    def report(self, msg: dict) -> None: ...


class NoMetrics:
    """Metrics off: every event is ignored."""

    def fault(self, kind: str) -> None:
        pass

    def round_started(self, round_no: int, world_size: int, nodes: int, reason: str, *, first: bool,
                      fault: bool, written: float = 0.0, mode: str = "restart") -> None:
        pass

    def heartbeat(self, rank: int, round_no: int, step: int) -> None:
        pass

    def report(self, msg: dict) -> None:
        pass


def metrics_for(enabled: bool, node_id: str, *, etcd_errors: Callable[[], int],
                replicas: Callable[[], dict[int, int] | None], replicas_refused: Callable[[], int]) -> Metrics:
    if not enabled:
        return NoMetrics()
    from ftrt.agents.ops.metrics import AgentMetrics

    return AgentMetrics(node_id, etcd_errors=etcd_errors, replicas=replicas, replicas_refused=replicas_refused)
