"""Configuration of one agent (``ftrt launch``), as a validated pydantic model.

The CLI (:mod:`ftrt.agents.cli`) maps flags onto these fields; embedding code can build the model
directly. A field that a flag sets takes its default from :mod:`ftrt.agents.launch_flags`, where the
flag's spellings and help are written. Validation errors name the field and the value;
:func:`load_config` turns pydantic's errors into one :class:`~ftrt.errors.ConfigError` sentence.
"""

from __future__ import annotations

import os
import socket
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ftrt.jobkeys import check_id
from ftrt.agents.launch_flags import DEFAULTS
from ftrt.agents.peers.tls import AgentTls
from ftrt.agents.workers.warmup import DEFAULT_WARM_IMPORTS, warm_imports_for
from ftrt.errors import ConfigError
from ftrt.store.access import EtcdAccess


class LaunchConfig(BaseModel):
    """Everything one agent needs to run its node's share of a job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    standalone: bool = Field(
        DEFAULTS["standalone"], description="Start an embedded etcd for this job (single node)."
    )
    etcd: Optional[str] = Field(None, description="etcd endpoints, HOST:PORT[,HOST:PORT...] "
                                "(https://HOST:PORT for TLS).")
    etcd_access: EtcdAccess = Field(
        default_factory=EtcdAccess,
        description="TLS files and user for etcd (--etcd-cacert/--etcd-cert/--etcd-key/--etcd-user); "
        "the agent's workers get the same through the environment.",
    )
    insecure_etcd: bool = Field(
        DEFAULTS["insecure_etcd"], description="Run on an etcd that admits anyone (no client certificate, no user) "
        "without the warning that anyone who reaches it can join the job."
    )
    job_id: str = Field(DEFAULTS["job_id"], description="Job id; every agent of a job uses the same one.")
    min_nodes: int = Field(
        DEFAULTS["min_nodes"], ge=1, description="Fewest nodes the job runs with (--nnodes MIN)."
    )
    max_nodes: int = Field(
        DEFAULTS["max_nodes"], ge=1, description="Most nodes the job runs with (--nnodes :MAX)."
    )
    nproc_per_node: int = Field(
        DEFAULTS["nproc_per_node"], ge=1, le=1024, description="Worker processes on this node."
    )
    node_id: str = Field(default_factory=socket.gethostname, description="This node's id in the job.")
    max_restarts: int = Field(
        DEFAULTS["max_restarts"], ge=0, description="Restarts after worker failures before the job fails."
    )
    lease_ttl: float = Field(
        DEFAULTS["lease_ttl"], ge=1.0, le=600.0,
        description="Seconds a node stays a member without renewing its lease (silent-failure detection).",
    )
    log_dir: Optional[str] = Field(None, description="Also write each worker's output to files here.")
    script: Optional[str] = Field(None, description="Training script to run (like torchrun's).")
    module: Optional[str] = Field(None, description="Run this module as a script (-m).")
    script_args: tuple[str, ...] = Field((), description="Arguments passed to the script.")
    host: Optional[str] = Field(
        None, description="Address other nodes reach this node at (default: the one that routes to etcd)."
    )
    agent_port: int = Field(
        DEFAULTS["agent_port"], ge=0, le=65535, description="Port of the agent's gRPC service (0: free port)."
    )
    join_timeout: float = Field(
        DEFAULTS["join_timeout"], gt=0, description="Seconds the job may stay below MIN nodes before it fails."
    )
    settle: float = Field(
        DEFAULTS["settle"], ge=0, description="Seconds of quiet after a loss or failure before the next round."
    )
    join_settle: float = Field(
        DEFAULTS["join_settle"], ge=0,
        description="Seconds a ready newcomer waits so that nodes starting together join together.",
    )
    first_round_wait: float = Field(
        DEFAULTS["first_round_wait"], ge=0,
        description="Once MIN nodes are ready, seconds to wait for more before round 1.",
    )
    hang_timeout: float = Field(
        DEFAULTS["hang_timeout"], gt=0,
        description="A worker that heartbeat once and then stays silent this long is killed as hung.",
    )
    teardown_timeout: float = Field(
        DEFAULTS["teardown_timeout"], gt=0,
        description="A worker that said its work is done (rt.done()) and has not exited this long after is "
                    "killed; its work counts as finished (a teardown stuck, e.g. in a process group's "
                    "destructor, does not hold the job forever).",
    )
    worker_start_timeout: float = Field(
        DEFAULTS["worker_start_timeout"], gt=0,
        description="A round's first worker (it holds the round's store) that has not started (reported "
                    "ready) this long is killed and the round restarted.",
    )
    stop_grace: float = Field(
        DEFAULTS["stop_grace"], ge=0, description="Seconds between SIGTERM and SIGKILL when the job stops."
    )
    restart_grace: float = Field(
        DEFAULTS["restart_grace"], ge=0,
        description="Seconds between SIGTERM and SIGKILL when a round change replaces workers "
        "(their process group is broken already; 0 kills at once).",
    )
    recovery: Literal["in-place", "restart"] = Field(
        DEFAULTS["recovery"],
        description="in-place: at a round change, workers that asked for it (rt.init_process_group) take the new "
        "round without exiting; only lost or failed workers are replaced. restart: every worker is replaced.",
    )
    reconfigure_timeout: float = Field(
        DEFAULTS["reconfigure_timeout"], gt=0,
        description="Seconds a worker kept in place may take to join its new round before it is killed and "
        "replaced (the round then restarts its workers).",
    )
    warm_workers: bool = Field(
        DEFAULTS["warm_workers"],
        description="Keep workers pre-started with torch imported so a restart skips the boot.",
    )
    warm_imports: tuple[str, ...] = Field(
        DEFAULT_WARM_IMPORTS,
        description="Modules a warm worker imports while it waits (torch._dynamo: DDP and optimizers "
        "import it on first use, 2-3 s here).",
    )
    exit_barrier_timeout: float = Field(
        DEFAULTS["exit_barrier_timeout"], ge=0,
        description="Seconds a finished node waits for the other members to finish.",
    )
    replica_interval: float = Field(
        DEFAULTS["replica_interval"], ge=0,
        description="Seconds between two copies to the peer node of a rank's memory "
        "checkpoint that holds every tensor whole (data parallel; the newest is sent; 0: every one). "
        "Sharded ranks are copied after every checkpoint.",
    )
    replicas: int = Field(
        DEFAULTS["replicas"], ge=1, description="Copies of each node's memory checkpoints on other nodes (its K ring "
        "successors): any K nodes lost at once still leave each lost rank's newest copy on a survivor.",
    )
    mtbf: Optional[float] = Field(
        None, gt=0, description="Mean seconds between faults (a node or a worker lost) to plan checkpoints "
        "for (workers read it as FTRT_MTBF; a checkpoint interval of 'auto' is chosen from it). Default: "
        "observed from the job's faults so far, or one hour while there are none. On 2 or more nodes a "
        "storage interval of 'auto' plans for losing every memory copy instead (the trainer's "
        "checkpoint.storage_mtbf).",
    )
    agent_tls: AgentTls = Field(
        default_factory=AgentTls,
        description="Mutual TLS between agents (--tls-cert/--tls-key/--tls-ca); plaintext when empty.",
    )
    checkpoint_key_file: Optional[str] = Field(
        None, description="File holding the job's checkpoint key: workers' checkpoints are summed with SHA-256 and "
        "signed with HMAC-SHA256, and restore refuses unsigned or foreign ones (workers get the path).",
    )
    metrics_port: Optional[int] = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics at http://HOST:PORT/metrics (HOST: --host; "
        "0 picks a free port, logged at start). Off by default.",
    )
    event_log: Optional[str] = Field(
        None, description="Append this node's events to this file, one JSON line each (time, node, round, kind).",
    )
    health_port: Optional[int] = Field(
        None, ge=0, le=65535, description="Also serve HTTP GET /healthz (live) and /readyz (workers in the current "
        "round) at http://HOST:PORT (0 picks a free port, logged at start). The gRPC health service on the agent's "
        "port is always on.",
    )
    drain_timeout: float = Field(
        DEFAULTS["drain_timeout"], ge=0,
        description="Seconds a draining node (SIGTERM, a preemption notice, ftrt drain) has to leave gracefully: "
        "the job ends the round at a step boundary without it and its state is handed over; past this it "
        "leaves as a crash would. 0: SIGTERM stops at once.",
    )
    preemption_file: Optional[str] = Field(
        None, description="Start a drain when this file appears (e.g. written by a node-termination handler).",
    )
    preemption_url: Optional[str] = Field(
        None, description="Poll this URL (e.g. a cloud's metadata endpoint) and start a drain when it answers "
        "200 with a body other than empty, FALSE or 0.",
    )
    preemption_poll: float = Field(
        DEFAULTS["preemption_poll"], gt=0, description="Seconds between two looks at --preemption-file/--preemption-url.",
    )
    peer_check_interval: float = Field(
        5.0, gt=0, description="Seconds between liveness beats on the streams to peer agents. A dead "
        "peer is seen when its stream's connection closes, not from missing beats; the beats only keep "
        "the stream in use, so they can be rare (each one wakes both agents on a busy node)."
    )

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, v: str) -> str:
        return check_id("job id", v)

    @field_validator("preemption_url")
    @classmethod
    def _preemption_url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http:// or https:// URL")
        return v

    @field_validator("checkpoint_key_file")
    @classmethod
    def _key_file(cls, v: Optional[str]) -> Optional[str]:
        return os.path.abspath(v) if v else None  # workers may run elsewhere in the tree

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str) -> str:
        return check_id("node id", v)

    @model_validator(mode="after")
    def _consistent(self) -> "LaunchConfig":
        if self.min_nodes > self.max_nodes:
            raise ValueError(
                f"--nnodes {self.min_nodes}:{self.max_nodes} has MIN above MAX; "
                f"write it as {self.max_nodes}:{self.min_nodes}"
            )
        if (self.script is None) == (self.module is None):
            raise ValueError("give exactly one of a script path or -m MODULE")
        if self.standalone and self.etcd:
            raise ValueError("--standalone starts its own etcd; do not also pass --etcd")
        if not self.standalone and not self.etcd:
            raise ValueError("pass --etcd HOST:PORT[,HOST:PORT...] or --standalone")
        if self.standalone and self.etcd_access.secured:
            raise ValueError("--standalone starts a local etcd with credentials of its own; the --etcd-* access "
                             "flags are for a given --etcd")
        if self.checkpoint_key_file is not None:
            from ftrt.checkpoint.signing import load_key

            try:
                load_key(self.checkpoint_key_file)
            except ConfigError as exc:
                raise ValueError(str(exc).rstrip(".")) from None
        if self.standalone and self.min_nodes > 1:
            raise ValueError(f"--standalone runs one node with an etcd of its own that no other node can reach, so "
                             f"--nnodes {self.min_nodes}:{self.max_nodes} could never start: for several nodes start "
                             "etcd (ftrt etcd) and launch each node with --etcd HOST:PORT")
        if self.script is not None and os.path.isdir(self.script):
            raise ValueError(f"the script {self.script!r} is a folder, not a Python file; give the script in it "
                             "(or -m MODULE for a package)")
        if self.script is not None and not os.path.isfile(self.script):
            raise ValueError(f"the script {self.script!r} does not exist (looked in {os.getcwd()})")
        return self

    @property
    def target(self) -> str:
        """The script path or ``-m module``, for messages."""
        return self.script if self.script is not None else f"-m {self.module}"


def load_config(**values) -> LaunchConfig:
    """Build a :class:`LaunchConfig`, raising :class:`ConfigError` with readable messages."""
    if "warm_imports" not in values:
        values["warm_imports"] = warm_imports_for(values.get("module"))
    try:
        return LaunchConfig(**values)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ").rstrip(".")
            if loc:
                parts.append(f"{loc.replace('_', '-')}={err.get('input')!r}: {msg}")
            else:
                parts.append(msg)
        raise ConfigError("Invalid launch configuration: " + "; ".join(parts) + ".") from None
