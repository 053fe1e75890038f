"""An elastic, in-place worker group for single-controller Ray programs (docs/ray.md).

The driver makes an :class:`ElasticGroup` of a worker class (``module:Class``), ``nproc_per_node``
workers on each Ray node, and calls methods on all of them with the results gathered
(:class:`ftrt.integrations.hostgroup.HostGroup`, whose docstring says what happens at a node's
loss or arrival). Here the node hosts are Ray actors, one per Ray node (node affinity), and a Ray
node's death reaches the driver as the death of its host actor.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ftrt.integrations.hostgroup import CallResult, Gone, GroupError, HostGroup, Node
from ftrt.integrations.ray.host import HostFailed, HostSpec, NodeHost

log = logging.getLogger(__name__)

__all__ = ["CallResult", "ElasticGroup", "GroupError", "RayPlacement"]


class RayPlacement:
    """Node hosts as Ray actors: one per alive Ray node that ``node_filter`` accepts (default: a node
    with a CPU), pinned to it."""

    def __init__(self, node_filter: Any = None) -> None:
        import ray

        self._ray = ray
        self._accept = node_filter or (lambda n: n["Resources"].get("CPU", 0) >= 1)
        self._host_cls = ray.remote(NodeHost)  # exported once: a join costs no export

    def nodes(self) -> list[Node]:
        return [Node(n["NodeID"], f"ray-{n['NodeID'][:12]}", n["NodeManagerAddress"]) for n in self._ray.nodes()
                if n["Alive"] and self._accept(n)]

    def driver_address(self) -> str:
        return self._ray.util.get_node_ip_address()

    def start(self, node: Node, spec: HostSpec) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return self._host_cls.options(
            num_cpus=0, max_concurrency=16, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.key, soft=False)).remote(spec)

    def submit(self, actor: Any, method: str, *args: Any) -> Future:
        return getattr(actor, method).remote(*args).future()

    def dumps(self, value: Any) -> bytes:
        from ray import cloudpickle

        return cloudpickle.dumps(value)

    def gone(self, exc: BaseException) -> Gone | None:
        errors = self._ray.exceptions
        if isinstance(exc, errors.ActorUnavailableError):
            return Gone("its host stayed unreachable", retry=True)  # Ray restarts a connection: ask again
        if isinstance(exc, errors.RayActorError):
            return Gone(f"its host died: {type(exc).__name__}")
        if isinstance(exc, HostFailed):
            return Gone(str(exc).splitlines()[0])
        return None

    def kill(self, actor: Any) -> None:
        self._ray.kill(actor)

    def forget(self, node: Node) -> None:
        pass  # a dead Ray node is not alive in ray.nodes(); one that comes back gets a host again


@dataclass
class ElasticGroup(HostGroup):
    """:class:`~ftrt.integrations.hostgroup.HostGroup` on the Ray cluster the driver is connected to.

    Args (besides the group's):
        node_filter: which Ray nodes get workers (``ray.nodes()`` entries; default: alive nodes
            with a CPU).
    """

    node_filter: Any = None

    def _placement(self) -> RayPlacement:
        return RayPlacement(self.node_filter)
