"""Chaos scenario files: a pydantic schema, loaded from YAML with errors that name the field.

A scenario describes the cluster (etcd members, nodes, workers per node, network namespaces,
checkpoint storage), the job (the built-in GRPO with config overrides), how many steps it trains,
a list of faults (``kind``, when: ``at_step`` or ``at_s``, ``target``: a node id or ``random``,
``duration_s`` where it applies), optionally a storm (random faults drawn from the run's seed,
see :func:`storm_faults`) and what must hold (maximum recovery time, equivalence to a fault-free
run, growth back). The reference for every field is ``docs/chaos.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import random

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ftrt.errors import ConfigError

FaultKind = Literal[
    "kill_worker", "kill_node", "freeze_worker", "freeze_node", "kill_etcd_member", "stop_etcd",
    "corrupt_checkpoint", "truncate_checkpoint", "add_node", "partition_node", "storage_outage",
    "storage_slow", "kill_rollout", "freeze_rollout", "add_rollout", "drain_node", "preempt_node",
]
DURATION_KINDS = {"freeze_worker", "freeze_node", "kill_etcd_member", "stop_etcd", "partition_node",
                  "storage_outage", "storage_slow", "freeze_rollout", "preempt_node"}
"""Faults that last: they need ``duration_s`` (``kill_node`` and ``drain_node`` take one optionally:
the node starts again after it; ``preempt_node``: the notice's lead before the SIGKILL)."""
NODE_KINDS = {"kill_worker", "kill_node", "freeze_worker", "freeze_node", "partition_node", "drain_node",
              "preempt_node"}
"""Faults whose ``target`` is a node."""
ROLLOUT_KINDS = {"kill_rollout", "freeze_rollout", "add_rollout"}
"""Faults of the rollout fleet (``cluster.rollout_servers``); ``target`` is a server (rollout0, ...)."""
STORM_KINDS = ("kill_worker", "kill_node", "freeze_worker", "freeze_node", "partition_node", "stop_etcd",
               "storage_outage", "storage_slow", "kill_rollout", "freeze_rollout", "add_rollout", "drain_node",
               "preempt_node")
"""What a storm may draw (each only where the cluster supports it)."""
PLANNED_KINDS = {"drain_node", "preempt_node"}
"""Planned departures: the job must redo no step for them (invariant ``nothing_redone``)."""


DEFAULT_FAULTY_MTBF_S = 60.0
"""The fault rate a scenario with faults tells its agents to expect unless it says otherwise: a
chaos run's faults come minutes apart at most, as an operator who knows the rate would configure."""


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
    mtbf: float | None = Field(None, gt=0, description="--mtbf of every agent: the seconds between faults "
                               "the job is told to expect (spare warm-up, auto checkpoint cadence); default: "
                               f"the storm's mtbf_s, else {DEFAULT_FAULTY_MTBF_S:g} when the scenario has faults")
    netns: bool = Field(False, description="each node in its own network namespace (root only; "
                        "needed by partition_node; scenarios are skipped with a reason elsewhere)")
    storage: Literal["local", "s3"] = Field("local", description="where checkpoints go: a local "
                                            "folder, or S3 (moto's server behind a TCP proxy; needed by storage_*)")
    etcd_security: Literal["none", "tls", "tls+auth"] = Field(
        "tls", description="etcd serves clients over TLS with client certificates (a CA made for the run; the "
        "default, closed as ftrt etcd is), and with tls+auth also requires a user and password; the agents get "
        "--etcd https://... and the --etcd-* access flags, as on a production cluster. none: plaintext, open "
        "to anyone who reaches it")
    agent_tls: bool = Field(False, description="agents speak mutual TLS to each other (--tls-cert/--tls-key/--tls-ca, "
                            "certificates made for the run)")
    recovery: Literal["in-place", "restart"] = Field(
        "in-place", description="--recovery of every agent: in-place (the default: at a round change the "
        "surviving workers keep their processes) or restart (every worker restarts); `ftrt chaos run "
        "--recovery` overrides it")
    rollout_servers: int = Field(0, ge=0, le=8, description="rollout servers (`ftrt rollout serve`, named rollout0, "
                                 "...) started beside the nodes; > 0 runs the job with rollout.mode=fleet")


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
    duration_s: float | None = Field(None, gt=0, description="how long the fault lasts (a freeze, "
                                     "an outage, a partition); kill_node, drain_node: restart the node after "
                                     "it; preempt_node: the notice's lead before the SIGKILL (then the "
                                     "node restarts, a replacement machine)")
    delay_s: float = Field(0.05, gt=0, le=5, description="storage_slow: seconds added to every "
                           "chunk the storage proxy forwards")

    @model_validator(mode="after")
    def _when(self) -> "Fault":
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("give exactly one of at_step and at_s")
        if self.kind in DURATION_KINDS and self.duration_s is None:
            raise ValueError(f"a {self.kind} fault needs duration_s")
        return self


class Storm(_Strict):
    """Random faults: gaps drawn from an exponential with mean ``mtbf_s``, kinds and targets at random."""

    mtbf_s: float = Field(gt=0, description="mean seconds between faults")
    duration_s: float = Field(gt=0, description="faults are drawn in [start_s, duration_s] seconds after the first step")
    start_s: float = Field(5.0, ge=0, description="no fault before this many seconds")
    kinds: list[FaultKind] = Field(default_factory=lambda: ["kill_worker", "kill_node", "freeze_worker"],
                                   description=f"kinds to draw from (any of {', '.join(STORM_KINDS)})")
    down_s: float = Field(10.0, gt=0, description="how long a killed node stays down, a freeze, "
                          "partition or outage lasts")


class Expect(_Strict):
    """What must hold at the end besides the standard invariants."""

    max_recovery_s: float = Field(30.0, gt=0, description="each fault: seconds to the next trained step")
    max_cold_recovery_s: float | None = Field(
        None, gt=0, description="a fault that met some agent's spare workers still warming (e.g. soon "
        "after a start or another fault): its limit instead of max_recovery_s (default: the larger of "
        "max_recovery_s and 30)")
    equivalence: Literal["exact", "ledger", "none"] = Field(
        "ledger", description="exact: per-step metrics equal a fault-free run's; ledger: the same "
        "prompts trained step for step; none: no comparison")
    world_grows: bool = Field(False, description="after its smallest, the world grows again (a node "
                              "added, restarted or healed joins before the job ends)")


class Scenario(_Strict):
    """A chaos scenario."""

    name: str = Field(description="short name")
    description: str = Field(description="one line: what it shows")
    cluster: Cluster = Field(default_factory=Cluster)
    job: Job = Field(default_factory=Job)
    steps: int = Field(40, ge=1, description="GRPO steps to train")
    faults: list[Fault] = Field(default_factory=list)
    storm: Storm | None = Field(None, description="random faults drawn from the run's seed, besides faults")
    expect: Expect = Field(default_factory=Expect)
    timeout_s: float = Field(300.0, gt=0, description="the whole run's limit")

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        nodes = {f"node{i}" for i in range(self.cluster.nodes + sum(f.kind == "add_node" for f in self.faults))}
        for i, f in enumerate(self.faults):
            if f.target != "random" and f.kind in NODE_KINDS and f.target not in nodes:
                raise ValueError(f"faults.{i}.target {f.target!r} is not a node of this cluster ({', '.join(sorted(nodes))})")
            if f.kind == "kill_etcd_member" and self.cluster.etcd_members < 3:
                raise ValueError(f"faults.{i}: kill_etcd_member needs cluster.etcd_members: 3")
            if f.kind == "partition_node" and not self.cluster.netns:
                raise ValueError(f"faults.{i}: partition_node needs cluster.netns: true")
            if f.kind.startswith("storage_") and self.cluster.storage != "s3":
                raise ValueError(f"faults.{i}: {f.kind} needs cluster.storage: s3")
            if f.kind.endswith("_checkpoint") and self.cluster.storage != "local":
                raise ValueError(f"faults.{i}: {f.kind} damages local files; it needs cluster.storage: local")
            if f.kind in ROLLOUT_KINDS and not self.cluster.rollout_servers:
                raise ValueError(f"faults.{i}: {f.kind} needs cluster.rollout_servers >= 1")
            if f.kind in ("kill_rollout", "freeze_rollout") and f.target != "random":
                servers = {f"rollout{j}" for j in range(self.cluster.rollout_servers
                                                        + sum(g.kind == "add_rollout" for g in self.faults))}
                if f.target not in servers:
                    raise ValueError(f"faults.{i}.target {f.target!r} is not a rollout server of this cluster "
                                     f"({', '.join(sorted(servers))})")
            if f.at_step is not None and f.at_step >= self.steps:
                raise ValueError(f"faults.{i}.at_step {f.at_step} is not before the last step ({self.steps - 1})")
        if self.cluster.rollout_servers and "rollout.mode" in self.job.grpo:
            raise ValueError("job.grpo.rollout.mode is set by cluster.rollout_servers (fleet when > 0); leave it out")
        if self.cluster.netns and self.cluster.agent_tls:
            raise ValueError("cluster.agent_tls needs loopback nodes: the agents' certificate names loopback "
                             "addresses only, so it cannot go with cluster.netns")
        if self.storm is not None:
            for kind in self.storm.kinds:
                if kind not in STORM_KINDS:
                    raise ValueError(f"storm.kinds: {kind} cannot be drawn (choose from {', '.join(STORM_KINDS)})")
                if kind == "partition_node" and not self.cluster.netns:
                    raise ValueError("storm.kinds: partition_node needs cluster.netns: true")
                if kind.startswith("storage_") and self.cluster.storage != "s3":
                    raise ValueError(f"storm.kinds: {kind} needs cluster.storage: s3")
                if kind in ROLLOUT_KINDS and not self.cluster.rollout_servers:
                    raise ValueError(f"storm.kinds: {kind} needs cluster.rollout_servers >= 1")
            if self.storm.duration_s <= self.storm.start_s:
                raise ValueError(f"storm.duration_s {self.storm.duration_s} must exceed storm.start_s {self.storm.start_s}")
        return self

    def agent_mtbf(self) -> float | None:
        """The ``--mtbf`` every agent gets (None: the agents' own default)."""
        if self.cluster.mtbf is not None:
            return self.cluster.mtbf
        if self.storm is not None:
            return self.storm.mtbf_s
        return DEFAULT_FAULTY_MTBF_S if self.faults else None


def storm_faults(storm: Storm, seed: int) -> list[Fault]:
    """The storm's faults for ``seed``: the same seed always draws the same times, kinds and durations.

    Gaps are exponential with mean ``mtbf_s`` from ``start_s`` on, until ``duration_s``; a killed
    node restarts after ``down_s``; targets stay ``random`` (drawn, also from the seed, when due).
    """
    rng = random.Random(f"storm-{seed}")
    out, t = [], storm.start_s
    while True:
        t += rng.expovariate(1.0 / storm.mtbf_s)
        if t > storm.duration_s:
            return out
        kind = rng.choice(storm.kinds)
        down = storm.down_s if kind in DURATION_KINDS or kind in ("kill_node", "kill_rollout", "drain_node") else None
        out.append(Fault(kind=kind, at_s=round(t, 2), duration_s=down))


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
    return validate(data, f"scenario {path}")


def validate(data: dict, what: str) -> Scenario:
    """A :class:`Scenario` from ``data``; :class:`ConfigError` names ``what`` and every bad field with its value."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "scenario"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown field {field!r}")
            elif not err["loc"]:  # a rule across fields: its message names them
                problems.append(msg)
            else:
                problems.append(f"field {field!r} = {err.get('input')!r}: {msg}")
        raise ConfigError(f"Invalid {what}: " + "; ".join(problems) + ". See docs/chaos.md.") from None


def builtin_dir() -> Path:
    return Path(__file__).with_name("scenarios")


def builtin() -> list[tuple[Path, Scenario]]:
    """The scenarios shipped in ``chaos/scenarios``, sorted by file name."""
    return [(p, load_scenario(p)) for p in sorted(builtin_dir().glob("*.yaml"))]
