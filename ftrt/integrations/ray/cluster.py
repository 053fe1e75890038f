"""A Ray cluster of several raylets ("nodes") on this machine, every process on 127.0.0.1.

``ray.cluster_utils.Cluster`` starts a head and worker raylets from this process; its nodes are
what :meth:`remove_node` kills, which makes node loss testable on one machine. Two settings keep
everything on loopback: ``node_ip_address="127.0.0.1"`` on every node, and Ray's single-machine
mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), without which a driver given a loopback address
rewrites it to the machine's interface address and waits for the GCS there forever. The head gets
no CPUs (no workers there); the health checks are tightened so a killed raylet is noticed within
about 1.5 s instead of Ray's default of about 15 s.
"""

from __future__ import annotations

import os
from typing import Any

SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
"""The head's health checks: a raylet that stops answering is declared dead after ~1.5 s."""


def loopback_cluster(nodes: int, cpus_per_node: int = 1, *, connect: bool = True,
                     system_config: dict[str, Any] | None = None) -> Any:
    """A ``ray.cluster_utils.Cluster`` of a head (no CPUs) and ``nodes`` worker raylets with
    ``cpus_per_node`` CPUs each, on 127.0.0.1; the driver connected to it when ``connect``. Shut it
    down with ``ray.shutdown(); cluster.shutdown()``."""
    os.environ[SINGLE_MACHINE_ENV] = "0"  # raylets and their workers inherit it
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import: this process may have imported ray before
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "_system_config": {**FAST_HEALTH_CHECKS, **(system_config or {})}})
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
    if connect:
        ray.init(address=cluster.address, log_to_driver=False)
    return cluster
