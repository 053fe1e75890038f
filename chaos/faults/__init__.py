"""Fault injectors for the chaos suite, one small module per family.

Every injector is ``inject(ctx, fault) -> Injected``: it acts at once and says what it hit and,
for faults that last (freezes, etcd outages), how to end them. :data:`INJECTORS` maps each
scenario ``kind`` to its injector.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ftrt.chaos.local import LocalNode


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
    killed: set[str] = field(default_factory=set)  # nodes whose agent a fault SIGKILLed

    def alive_nodes(self) -> list[str]:
        return sorted(n for n, node in self.nodes.items() if node.alive())

    def pick_node(self, target: str) -> str:
        if target != "random":
            return target
        alive = self.alive_nodes()
        if not alive:
            raise RuntimeError("no node is alive to inject a fault into")
        return self.rng.choice(alive)


@dataclass
class Injected:
    target: str
    end: Callable[[], None] | None = None
    detail: str = ""


def _injectors() -> dict[str, Callable[[Context, Any], Injected]]:
    from ftrt.chaos.faults import etcd, files, membership, process

    return {
        "kill_worker": process.kill_worker, "kill_node": process.kill_node,
        "freeze_worker": process.freeze_worker, "freeze_node": process.freeze_node,
        "kill_etcd_member": etcd.kill_member, "stop_etcd": etcd.stop_all,
        "corrupt_checkpoint": files.corrupt, "truncate_checkpoint": files.truncate,
        "add_node": membership.add_node,
    }


def injector(kind: str) -> Callable[[Context, Any], Injected]:
    return _injectors()[kind]
