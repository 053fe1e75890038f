"""``ftrt launch``: the command line of one agent, a drop-in for torchrun.

torchrun's spellings are accepted as aliases (``--rdzv-endpoint``, ``--rdzv-id``,
``--nproc_per_node``, underscores for dashes), so an existing torchrun command line needs only its
first word changed. Options that only make sense for torchrun's own rendezvous backends
(``--rdzv-backend``, ``--rdzv-conf``) are accepted and ignored with a note.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from ftrt.errors import ConfigError
from ftrt.agents import tls as agent_tls
from ftrt.store import access

if TYPE_CHECKING:  # the config module imports pydantic; keep it off the fast start path
    from ftrt.agents.config import LaunchConfig

log = logging.getLogger(__name__)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max), with messages that name the value."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            lo, hi = n, n
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} is not N or MIN:MAX (e.g. --nnodes 2:4).") from None
    if lo < 1:
        raise ConfigError(f"--nnodes {text!r}: MIN must be at least 1.")
    if lo > hi:
        raise ConfigError(f"--nnodes {text!r} has MIN above MAX; write it as {hi}:{lo}.")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftrt launch",
        description="Run SCRIPT (or -m MODULE) on this node under an ftrt agent, torchrun-compatibly.",
    )
    add = p.add_argument
    add("--standalone", action="store_true", help="start an embedded etcd for a single-node job")
    add("--etcd", "--rdzv-endpoint", "--rdzv_endpoint", dest="etcd", metavar="HOST:PORT[,...]",
        help="etcd endpoints of the job")
    add("--job-id", "--rdzv-id", "--rdzv_id", "--run-id", dest="job_id", default=None,
        help="job id shared by all agents of the job (default: 'default')")
    add("--nnodes", default="1", help="N or MIN:MAX nodes (default 1)")
    add("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=1,
        help="worker processes on this node (default 1)")
    add("--node-id", "--node_id", dest="node_id", default=None, help="this node's id (default: hostname)")
    add("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=3,
        help="restarts after worker failures before the job fails (default 3)")
    add("--lease-ttl", "--lease_ttl", dest="lease_ttl", type=float, default=5.0,
        help="seconds a silent node stays a member (default 5)")
    add("--log-dir", "--log_dir", dest="log_dir", default=None, help="also write worker output here")
    add("--host", "--local-addr", "--local_addr", dest="host", default=None,
        help="address other nodes reach this node at (default: the one routing to etcd)")
    add("--agent-port", dest="agent_port", type=int, default=0, help="agent gRPC port (default: free port)")
    add("--join-timeout", dest="join_timeout", type=float, default=600.0,
        help="seconds the job may wait below MIN nodes before failing (default 600)")
    add("--hang-timeout", dest="hang_timeout", type=float, default=60.0,
        help="seconds without heartbeat (after the first) before a worker is killed as hung (default 60)")
    add("--settle", type=float, default=0.05, help="seconds of quiet after a fault before the next round")
    add("--join-settle", dest="join_settle", type=float, default=0.2,
        help="seconds a ready newcomer waits so nodes starting together join together")
    add("--first-round-wait", dest="first_round_wait", type=float, default=0.5,
        help="once MIN nodes are ready, seconds to wait for more before the first round")
    add("--stop-grace", dest="stop_grace", type=float, default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping workers at the end")
    add("--restart-grace", dest="restart_grace", type=float, default=0.0,
        help="seconds between SIGTERM and SIGKILL when a new round replaces workers (default 0)")
    add("--no-warm", dest="warm_workers", action="store_false", help="start workers cold (no spares)")
    add("--warm-import", dest="warm_imports", action="append", default=None, metavar="MODULE",
        help="module spares import while waiting (repeatable; default torch, torch.distributed, torch.nn.parallel, "
             "torch._dynamo, DCP and ftrt's checkpointer, plus the package of an ftrt module run with -m)")
    add("--exit-barrier-timeout", dest="exit_barrier_timeout", type=float, default=300.0,
        help="seconds a finished node waits for the others")
    add("--replica-interval", dest="replica_interval", type=float, default=10.0,
        help="seconds between two copies of a data-parallel rank's memory checkpoint to the peer node "
             "(default 10; 0: every one; sharded ranks: every one)")
    add("--replicas", type=int, default=1, metavar="K",
        help="copies of each node's memory checkpoints on other nodes (its K ring successors; default 1): "
             "any K nodes lost at once still restore from memory")
    add("--mtbf", type=float, default=None, metavar="SECONDS",
        help="mean seconds between failures to plan checkpoint cadence for (default: observed from the "
             "job's faults, or one hour while there are none)")
    add("--checkpoint-key-file", dest="checkpoint_key_file", default=None, metavar="FILE",
        help="the job's checkpoint key: checkpoints are signed (HMAC-SHA256) and only signed ones restored")
    add("--metrics-port", dest="metrics_port", type=int, default=None, metavar="PORT",
        help="serve Prometheus metrics on --host's address at this port (0: a free one; see docs/metrics.md)")
    add("--event-log", dest="event_log", default=None, metavar="FILE",
        help="append this node's events to FILE, one JSON line each")
    access.add_arguments(p.add_argument_group("etcd security (TLS and auth)"))
    agent_tls.add_arguments(p.add_argument_group("agent security (mutual TLS between agents)"))
    add("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None, help=argparse.SUPPRESS)
    add("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default=None, help=argparse.SUPPRESS)
    add("-m", "--module", dest="is_module", action="store_true", help="run TARGET as a module (python -m)")
    add("target", nargs="?", help="training script (or module with -m)")
    add("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_launch_args(argv: list[str]) -> "LaunchConfig":
    """Turn ``ftrt launch`` arguments into a validated :class:`LaunchConfig`."""
    return config_from_namespace(build_parser().parse_args(argv))


def config_from_namespace(ns: argparse.Namespace) -> "LaunchConfig":
    """Validate parsed ``ftrt launch`` arguments into a :class:`LaunchConfig`."""
    from ftrt.agents.config import load_config

    if ns.target is None:
        raise ConfigError("Give the training script to run (or -m MODULE), e.g. ftrt launch train.py.")
    for ignored in ("rdzv_backend", "rdzv_conf"):
        if getattr(ns, ignored):
            log.info("--%s is a torchrun option and is ignored: ftrt's rendezvous is etcd", ignored.replace("_", "-"))
    lo, hi = parse_nnodes(ns.nnodes)
    values = dict(
        standalone=ns.standalone, etcd=ns.etcd, min_nodes=lo, max_nodes=hi,
        nproc_per_node=ns.nproc_per_node, max_restarts=ns.max_restarts, lease_ttl=ns.lease_ttl,
        log_dir=ns.log_dir, host=ns.host, agent_port=ns.agent_port, join_timeout=ns.join_timeout,
        hang_timeout=ns.hang_timeout, settle=ns.settle, join_settle=ns.join_settle,
        first_round_wait=ns.first_round_wait, stop_grace=ns.stop_grace,
        restart_grace=ns.restart_grace, warm_workers=ns.warm_workers,
        exit_barrier_timeout=ns.exit_barrier_timeout, replica_interval=ns.replica_interval,
        replicas=ns.replicas, mtbf=ns.mtbf, script_args=tuple(ns.args), etcd_access=access.from_args(ns),
        metrics_port=ns.metrics_port, event_log=ns.event_log, checkpoint_key_file=ns.checkpoint_key_file,
        agent_tls=agent_tls.from_args(ns),
    )
    if ns.is_module:
        values["module"] = ns.target
    else:
        values["script"] = ns.target
    if ns.job_id is not None:
        values["job_id"] = ns.job_id
    if ns.node_id is not None:
        values["node_id"] = ns.node_id
    if ns.warm_imports:
        values["warm_imports"] = tuple(ns.warm_imports)
    return load_config(**values)


def launch_main(argv: list[str]) -> int:
    from ftrt.agents.early import EarlyStart
    from ftrt.agents.workers import warm_imports_for

    ns = build_parser().parse_args(argv)
    early = None
    if ns.target is not None and ns.warm_workers and 1 <= ns.nproc_per_node <= 1024:
        # Spares start now, before the imports below: see ftrt.agents.early.
        early = EarlyStart.begin(
            nproc=ns.nproc_per_node, warm=True,
            warm_imports=tuple(ns.warm_imports) if ns.warm_imports else
            warm_imports_for(ns.target if ns.is_module else None),
        )
    try:
        cfg = config_from_namespace(ns)
        from ftrt.agents.agent import run_agent
    except BaseException:
        if early is not None:
            early.discard()
        raise
    return run_agent(cfg, early)
