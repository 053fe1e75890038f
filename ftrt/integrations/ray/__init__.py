"""ftrt for single-controller Ray programs: an elastic worker group whose survivors keep their
processes when a Ray node dies (docs/ray.md).

- :class:`ElasticGroup` (driver side): ``n`` workers of a class on each Ray node, called together;
- :mod:`~ftrt.integrations.ray.host`: the per-node host actor that runs the node's ftrt agent;
- :mod:`~ftrt.integrations.ray.worker`: the worker process that holds the worker object;
- :func:`loopback_cluster`: a Ray cluster of several raylets on this machine, loopback only (tests,
  examples, benchmarks).

Ray is imported only when a group or a cluster is made: ``import ftrt`` never needs it.
"""

from ftrt.integrations.ray.cluster import loopback_cluster
from ftrt.integrations.ray.group import CallResult, ElasticGroup, GroupError

__all__ = ["CallResult", "ElasticGroup", "GroupError", "loopback_cluster"]
