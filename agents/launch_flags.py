"""The ``ftrt launch`` flags: the one place each flag's spellings, default and help are written.

:mod:`ftrt.agents.cli` builds its parser, and turns parsed flags into a
:class:`~ftrt.agents.config.LaunchConfig`, from :data:`FLAGS`; the config takes each flagged field's
default from :data:`DEFAULTS`. A field without a flag is named in :data:`NO_FLAG`, with why
(``tests/agents/test_cli_config.py`` checks that every field is one or the other).

This module is on the agent's start path: ``ftrt launch`` parses its flags and starts its spare
workers before the agent's heavier imports (see :mod:`ftrt.agents.workers.early`). So it imports no pydantic,
and its records are named tuples, which cost less to define than dataclasses.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple

from ftrt.agents.peers import tls as agent_tls
from ftrt.errors import ConfigError
from ftrt.store import access


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


def _nnodes(text: str) -> dict[str, int]:
    lo, hi = parse_nnodes(text)
    return {"min_nodes": lo, "max_nodes": hi}


def _recovery(text: str) -> str:
    if text not in ("in-place", "restart"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a recovery mode: write in-place or restart")
    return text


def _shown(default: Any) -> Any:
    """A default as ``--help`` shows it: 5.0 as 5."""
    return int(default) if isinstance(default, float) and default.is_integer() else default


class Flag(NamedTuple):
    """One ``ftrt launch`` option and the :class:`LaunchConfig` field it sets.

    Args:
        dest: the argparse attribute, and the field it sets unless ``to_config`` says otherwise.
        names: its spellings; the first is the flag's own, the rest aliases (torchrun's).
        default: the value when the flag is not given; ``None``: the field's own (the help says which).
        help: the ``--help`` line; ``{default}`` in it shows ``default``.
        type, metavar, action: as for :meth:`argparse.ArgumentParser.add_argument`.
        to_config: the fields a given value sets, where that is not ``{dest: value}``.
    """

    dest: str
    names: tuple[str, ...]
    default: Any
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    action: str | None = None
    to_config: Callable[[Any], dict[str, Any]] | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        given = dict(type=self.type, metavar=self.metavar, action=self.action)
        parser.add_argument(*self.names, dest=self.dest, default=self.default,
                            help=self.help.format(default=_shown(self.default)),
                            **{k: v for k, v in given.items() if v is not None})

    def config_values(self, value: Any) -> dict[str, Any]:
        """The config fields ``value`` sets (a repeated flag's list as a tuple); none for ``None``
        (not given: the field keeps the config's default)."""
        if value is None:
            return {}
        if self.to_config is not None:
            return self.to_config(value)
        return {self.dest: tuple(value) if isinstance(value, list) else value}

    def from_args(self, ns: argparse.Namespace) -> dict[str, Any]:
        return self.config_values(getattr(ns, self.dest))

    @property
    def config_fields(self) -> tuple[str, ...]:
        return tuple(self.to_config(self.default)) if self.to_config is not None else (self.dest,)


class FlagGroup(NamedTuple):
    """Flags that build one field, owned by the module of that field's type (other commands, such as
    ``ftrt status``, take the same flags); they show under their own heading in ``--help``."""

    dest: str
    title: str
    add_arguments: Callable[[argparse._ArgumentGroup], None]
    read: Callable[[argparse.Namespace], Any]

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        self.add_arguments(parser.add_argument_group(self.title))

    def from_args(self, ns: argparse.Namespace) -> dict[str, Any]:
        return {self.dest: self.read(ns)}

    @property
    def config_fields(self) -> tuple[str, ...]:
        return (self.dest,)


FLAGS: tuple[Flag | FlagGroup, ...] = (
    Flag("standalone", ("--standalone",), False, "start an embedded etcd for a single-node job",
         action="store_true"),
    Flag("etcd", ("--etcd", "--rdzv-endpoint", "--rdzv_endpoint"), None, "etcd endpoints of the job",
         metavar="HOST:PORT[,...]"),
    Flag("insecure_etcd", ("--insecure-etcd",), False, "run on an etcd that admits anyone, without the warning "
         "(anyone who reaches it can join the job)", action="store_true"),
    Flag("job_id", ("--job-id", "--rdzv-id", "--rdzv_id", "--run-id"), "default",
         "job id shared by all agents of the job (default: {default!r})"),
    Flag("nnodes", ("--nnodes",), "1", "N or MIN:MAX nodes (default {default})", to_config=_nnodes),
    Flag("nproc_per_node", ("--nproc-per-node", "--nproc_per_node"), 1,
         "worker processes on this node (default {default})", type=int),
    Flag("node_id", ("--node-id", "--node_id"), None, "this node's id (default: hostname)"),
    Flag("max_restarts", ("--max-restarts", "--max_restarts"), 3,
         "restarts after worker failures before the job fails (default {default})", type=int),
    Flag("lease_ttl", ("--lease-ttl", "--lease_ttl"), 5.0, "seconds a silent node stays a member (default {default})",
         type=float),
    Flag("log_dir", ("--log-dir", "--log_dir"), None, "also write worker output here"),
    Flag("host", ("--host", "--local-addr", "--local_addr"), None,
         "address other nodes reach this node at (default: the one routing to etcd)"),
    Flag("agent_port", ("--agent-port",), 0, "agent gRPC port (default: free port)", type=int),
    Flag("join_timeout", ("--join-timeout",), 600.0,
         "seconds the job may wait below MIN nodes before failing (default {default})", type=float),
    Flag("hang_timeout", ("--hang-timeout",), 60.0,
         "seconds without heartbeat (after the first) before a worker is killed as hung (default {default})",
         type=float),
    Flag("teardown_timeout", ("--teardown-timeout",), 120.0,
         "seconds a worker that said it is done (rt.done()) may take to exit before it is killed; its work "
         "counts as finished (default {default})", type=float),
    Flag("worker_start_timeout", ("--worker-start-timeout",), 300.0,
         "seconds a round's first worker (it holds the round's store) may take to start before the round is "
         "restarted (default {default})", type=float),
    Flag("settle", ("--settle",), 0.05, "seconds of quiet after a fault before the next round", type=float),
    Flag("join_settle", ("--join-settle",), 0.2,
         "seconds a ready newcomer waits so nodes starting together join together", type=float),
    Flag("first_round_wait", ("--first-round-wait",), 0.5,
         "once MIN nodes are ready, seconds to wait for more before the first round", type=float),
    Flag("stop_grace", ("--stop-grace",), 5.0,
         "seconds between SIGTERM and SIGKILL when stopping workers at the end", type=float),
    Flag("restart_grace", ("--restart-grace",), 0.0,
         "seconds between SIGTERM and SIGKILL when a new round replaces workers (default {default})", type=float),
    Flag("recovery", ("--recovery",), "in-place",
         "in-place: at a round change, workers that ask for it (rt.init_process_group) take the new round "
         "without exiting and only lost or failed ones are replaced; restart: every worker is replaced "
         "(default {default}; a script that never asks is restarted either way)", type=_recovery),
    Flag("reconfigure_timeout", ("--reconfigure-timeout",), 10.0,
         "seconds a worker kept in place may take to join the new round before it is killed and replaced "
         "(default {default})", type=float),
    Flag("warm_workers", ("--no-warm",), True, "start workers cold (no spares)", action="store_false"),
    Flag("warm_imports", ("--warm-import",), None,
         "module spares import while waiting (repeatable; default torch, torch.distributed, torch.nn.parallel, "
         "torch._dynamo, DCP and ftrt's checkpointer, plus the package of an ftrt module run with -m)",
         metavar="MODULE", action="append"),
    Flag("exit_barrier_timeout", ("--exit-barrier-timeout",), 300.0, "seconds a finished node waits for the others",
         type=float),
    Flag("replica_interval", ("--replica-interval",), 10.0,
         "seconds between two copies of a data-parallel rank's memory checkpoint to the peer node "
         "(default {default}; 0: every one; sharded ranks: every one)", type=float),
    Flag("replicas", ("--replicas",), 1,
         "copies of each node's memory checkpoints on other nodes (its K ring successors; default {default}): "
         "any K nodes lost at once still restore from memory", type=int, metavar="K"),
    Flag("mtbf", ("--mtbf",), None,
         "mean seconds between faults (a node or a worker lost) to plan checkpoint cadence for (default: "
         "observed from the job's faults, or one hour while there are none); on 2 or more nodes storage "
         "plans for losing every memory copy instead", type=float, metavar="SECONDS"),
    Flag("checkpoint_key_file", ("--checkpoint-key-file",), None,
         "the job's checkpoint key: checkpoints are signed (HMAC-SHA256) and only signed ones restored",
         metavar="FILE"),
    Flag("metrics_port", ("--metrics-port",), None,
         "serve Prometheus metrics on --host's address at this port (0: a free one; see docs/metrics.md)",
         type=int, metavar="PORT"),
    Flag("event_log", ("--event-log",), None, "append this node's events to FILE, one JSON line each",
         metavar="FILE"),
    Flag("health_port", ("--health-port",), None,
         "also serve HTTP /healthz (live) and /readyz (workers in the current round) on --host's address at this "
         "port (0: a free one); the agent's gRPC port always answers grpc.health.v1", type=int, metavar="PORT"),
    Flag("drain_timeout", ("--drain-timeout",), 25.0,
         "on SIGTERM, a preemption notice or ftrt drain: seconds to leave gracefully (the round ends at a step "
         "boundary without this node, its state is handed over, exit 0); past it, leave as a crash would; a "
         "second SIGTERM leaves at once (default {default}; 0: SIGTERM stops at once)", type=float,
         metavar="SECONDS"),
    Flag("preemption_file", ("--preemption-file",), None, "drain when this file appears", metavar="PATH"),
    Flag("preemption_url", ("--preemption-url",), None,
         "poll this URL (a cloud's preemption notice) and drain when it answers 200 with a body other than "
         "empty, FALSE or 0", metavar="URL"),
    Flag("preemption_poll", ("--preemption-poll",), 2.0,
         "seconds between two looks at --preemption-file/--preemption-url (default {default})", type=float,
         metavar="SECONDS"),
    FlagGroup("etcd_access", "etcd security (TLS and auth)", access.add_arguments, access.from_args),
    FlagGroup("agent_tls", "agent security (mutual TLS between agents)", agent_tls.add_arguments,
              agent_tls.from_args),
)
"""Every ``ftrt launch`` option, in ``--help``'s order."""

DEFAULTS: dict[str, Any] = {
    field: value for flag in FLAGS if isinstance(flag, Flag)
    for field, value in flag.config_values(flag.default).items()
}
"""The :class:`LaunchConfig` default of each field whose flag has a default."""

IGNORED: tuple[tuple[str, ...], ...] = (("--rdzv-backend", "--rdzv_backend"), ("--rdzv-conf", "--rdzv_conf"))
"""torchrun options for its own rendezvous backends: accepted, and ignored with a note (ftrt's
rendezvous is etcd). They are not shown in ``--help``."""

NO_FLAG: dict[str, str] = {
    "script": "the TARGET argument",
    "module": "the TARGET argument with -m",
    "script_args": "the arguments after TARGET",
    "peer_check_interval": "tuning for code that builds the config itself; no flag",
}
"""The :class:`LaunchConfig` fields no option sets, and what does."""
