"""ftrt for single-controller Ray programs: an elastic worker group whose survivors keep their
processes when a Ray node dies (docs/ray.md).

- :class:`ElasticGroup` (driver side): ``n`` workers of a class on each Ray node, called together;
- :mod:`~ftrt.integrations.ray.host`: the per-node host actor that runs the node's ftrt agent;
- :mod:`~ftrt.integrations.ray.worker`: the worker process that holds the worker object;
- :func:`loopback_cluster`: a Ray cluster of several raylets on this machine, loopback only (tests,
  examples, benchmarks).

Ray is imported only when a group or a cluster is made: ``import ftrt`` never needs it.
"""

from typing import Any

__all__ = ["CallResult", "ElasticGroup", "GroupError", "loopback_cluster"]


def __getattr__(name: str) -> Any:
    # Lazy: the host, wire and worker modules here are shared with the Monarch group, whose core
    # (ftrt.integrations.hostgroup) imports them; the group itself imports that core.
    if name == "loopback_cluster":
        from ftrt.integrations.ray.cluster import loopback_cluster

        return loopback_cluster
    if name in ("CallResult", "ElasticGroup", "GroupError"):
        from ftrt.integrations.ray import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
