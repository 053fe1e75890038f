"""Fault injectors for the chaos suite, one small module per family.

Every injector is ``inject(ctx, fault) -> Injected``: it acts at once and says what it hit and,
for faults that last (freezes, outages, partitions, a node down for a while), how to end them. :data:`INJECTORS` maps each
scenario ``kind`` to its injector.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ftrt.chaos.local import LocalNode


def preemption_path(work: Path, job_id: str, node_id: str) -> Path:
    """The file a chaos run's node watches for a preemption notice (the runner passes it as
    ``--preemption-file``; ``preempt_node`` writes it)."""
    return work / f"preempt-{job_id}-{node_id}"


@dataclass
class Context:
    """What injectors may act on: the running cluster and the job's files."""

    nodes: dict[str, LocalNode]
    etcd: Any  # EtcdServer or EtcdCluster
    etcd_endpoints: str
    job_id: str
    ckpt_dir: Path
    rng: random.Random
    start_node: Callable[[str], LocalNode]
    corrupted_steps: set[int] = field(default_factory=set)
    killed: set[str] = field(default_factory=set)  # nodes whose agent a fault SIGKILLed (and not restarted)
    lab: Any = None  # ftrt.chaos.netns.NetLab when the nodes have their own network namespaces
    storage_proxy: Any = None  # ftrt.chaos.proxy.TcpProxy in front of S3 when checkpoints go there
    etcd_access: Any = None  # ftrt.store.access.EtcdAccess when etcd runs with TLS or auth
    metrics_ports: dict[str, int] = field(default_factory=dict)  # node -> its agent's --metrics-port
    busy: set[str] = field(default_factory=set)  # nodes a lasting fault (freeze, partition, down) holds now

    @staticmethod
    def node_index(node_id: str) -> int:
        return int(node_id.removeprefix("node"))

    agent_tls: Any = None  # ftrt.agents.peers.tls.AgentTls when agents speak mutual TLS
    rollouts: Any = None  # ftrt.chaos.faults.rollout.RolloutServers when the job has a rollout fleet

    def status_access(self) -> dict:
        """Keyword arguments that give a status query this cluster's etcd and agent credentials."""
        out = {"access": self.etcd_access} if self.etcd_access is not None else {}
        return {**out, "agent_tls": self.agent_tls} if self.agent_tls is not None else out

    def preemption_file(self, node_id: str) -> Path:
        """Where ``node_id``'s agent looks for a preemption notice (``--preemption-file``)."""
        return preemption_path(self.ckpt_dir.parent, self.job_id, node_id)

    def alive_nodes(self) -> list[str]:
        return sorted(n for n, node in self.nodes.items() if node.alive())

    def pick_node(self, target: str, among: list[str] | None = None) -> str:
        """``target``, or for ``random`` a live node (of ``among``) that no lasting fault holds now."""
        if target != "random":
            return target
        alive = [n for n in self.alive_nodes() if n not in self.busy and (among is None or n in among)]
        if not alive:
            raise RuntimeError("no node is alive (and free of other faults) to inject a fault into")
        return self.rng.choice(alive)


@dataclass
class Injected:
    target: str
    end: Callable[[], None] | None = None
    detail: str = ""


def _injectors() -> dict[str, Callable[[Context, Any], Injected]]:
    from ftrt.chaos.faults import etcd, files, membership, network, process, rollout, storage

    return {
        "kill_worker": process.kill_worker, "kill_node": process.kill_node,
        "freeze_worker": process.freeze_worker, "freeze_node": process.freeze_node,
        "kill_etcd_member": etcd.kill_member, "stop_etcd": etcd.stop_all,
        "corrupt_checkpoint": files.corrupt, "truncate_checkpoint": files.truncate,
        "add_node": membership.add_node, "partition_node": network.partition_node,
        "storage_outage": storage.outage, "storage_slow": storage.slow,
        "kill_rollout": rollout.kill_rollout, "freeze_rollout": rollout.freeze_rollout,
        "add_rollout": rollout.add_rollout, "drain_node": process.drain_node, "preempt_node": process.preempt_node,
    }


def injector(kind: str) -> Callable[[Context, Any], Injected]:
    return _injectors()[kind]
