"""Chaos scenario files: a pydantic schema, loaded from YAML with errors that name the field.

A scenario describes the cluster (etcd members, nodes, workers per node), the job (the built-in
GRPO with config overrides), how many steps it trains, a list of faults (``kind``, when:
``at_step`` or ``at_s``, ``target``: a node id or ``random``, ``duration_s`` where it applies)
and what must hold (maximum recovery time, equivalence to a fault-free run). The reference for
every field is ``docs/chaos.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ftrt.errors import ConfigError

FaultKind = Literal[
    "kill_worker", "kill_node", "freeze_worker", "freeze_node", "kill_etcd_member", "stop_etcd",
    "corrupt_checkpoint", "truncate_checkpoint", "add_node",
]
DURATION_KINDS = {"freeze_worker", "freeze_node", "kill_etcd_member", "stop_etcd"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Cluster(_Strict):
    """The local cluster the scenario runs on."""

    etcd_members: Literal[1, 3] = Field(1, description="etcd members (3 for member-loss faults)")
    nodes: int = Field(2, ge=1, le=8, description="nodes (one agent each) at the start")
    workers_per_node: int = Field(1, ge=1, le=4, description="workers per node (--nproc-per-node)")
    min_nodes: int | None = Field(None, ge=1, description="--nnodes MIN (default 1)")
    lease_ttl: float = Field(2.0, gt=0, description="--lease-ttl of every agent")
    hang_timeout: float = Field(10.0, gt=0, description="--hang-timeout of every agent")


class Job(_Strict):
    """The job: the built-in GRPO trainer (``-m ftrt.grpo``) with config overrides."""

    grpo: dict[str, Any] = Field(default_factory=dict, description="ftrt.grpo config fields "
                                 "(dotted keys allowed); steps, metrics_path and checkpoint.url are set by the runner")


class Fault(_Strict):
    """One fault: what, when, on which target, for how long."""

    kind: FaultKind
    at_step: int | None = Field(None, ge=0, description="inject once rank 0 has logged this step")
    at_s: float | None = Field(None, ge=0, description="inject this many seconds after the first step")
    target: str = Field("random", description="a node id (node0, node1, ...) or random")
    duration_s: float | None = Field(None, gt=0, description="how long a freeze or an etcd outage lasts")

    @model_validator(mode="after")
    def _when(self) -> "Fault":
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("give exactly one of at_step and at_s")
        if self.kind in DURATION_KINDS and self.duration_s is None:
            raise ValueError(f"a {self.kind} fault needs duration_s")
        return self


class Expect(_Strict):
    """What must hold at the end besides the standard invariants."""

    max_recovery_s: float = Field(30.0, gt=0, description="each fault: seconds to the next trained step")
    equivalence: Literal["exact", "ledger", "none"] = Field(
        "ledger", description="exact: per-step metrics equal a fault-free run's; ledger: the same "
        "prompts trained step for step; none: no comparison")


class Scenario(_Strict):
    """A chaos scenario."""

    name: str = Field(description="short name")
    description: str = Field(description="one line: what it shows")
    cluster: Cluster = Field(default_factory=Cluster)
    job: Job = Field(default_factory=Job)
    steps: int = Field(40, ge=1, description="GRPO steps to train")
    faults: list[Fault] = Field(default_factory=list)
    expect: Expect = Field(default_factory=Expect)
    timeout_s: float = Field(300.0, gt=0, description="the whole run's limit")

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        nodes = {f"node{i}" for i in range(self.cluster.nodes + sum(f.kind == "add_node" for f in self.faults))}
        for i, f in enumerate(self.faults):
            if f.target != "random" and f.kind not in ("add_node", "kill_etcd_member", "stop_etcd") \
                    and f.target not in nodes:
                raise ValueError(f"faults.{i}.target {f.target!r} is not a node of this cluster ({', '.join(sorted(nodes))})")
            if f.kind == "kill_etcd_member" and self.cluster.etcd_members < 3:
                raise ValueError(f"faults.{i}: kill_etcd_member needs cluster.etcd_members: 3")
            if f.at_step is not None and f.at_step >= self.steps:
                raise ValueError(f"faults.{i}.at_step {f.at_step} is not before the last step ({self.steps - 1})")
        return self


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; :class:`ConfigError` names the file and field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"Cannot read the scenario {path}: {exc.strerror}.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"The scenario {path} is not valid YAML: {exc}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"The scenario {path} must be a mapping of fields.")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "scenario"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown field {field!r}")
            else:
                problems.append(f"field {field!r} = {err.get('input')!r}: {msg}")
        raise ConfigError(f"Invalid scenario {path}: " + "; ".join(problems) + ". See docs/chaos.md.") from None


def builtin_dir() -> Path:
    return Path(__file__).with_name("scenarios")


def builtin() -> list[tuple[Path, Scenario]]:
    """The scenarios shipped in ``chaos/scenarios``, sorted by file name."""
    return [(p, load_scenario(p)) for p in sorted(builtin_dir().glob("*.yaml"))]
