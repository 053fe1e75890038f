"""The ``ftrt`` console script: one entry, one subcommand per job.

Subcommands import their implementation lazily so ``ftrt --version`` and ``ftrt launch`` start
fast (no torch import in the agent). Errors derived from :class:`~ftrt.errors.FtrtError` print as
one ``ftrt: error: ...`` line, without a traceback, and exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Callable, Sequence

from ftrt._version import __version__
from ftrt.cli.signals import Stopped, stop_cleanly
from ftrt.errors import FtrtError

Handler = Callable[[argparse.Namespace, list[str]], int]


def _cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.agents.cli import launch_main

    return launch_main(rest)


def _cmd_status(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.agents.ops.status import status_main

    return status_main(rest)


def _cmd_drain(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.agents.ops.drain import drain_main

    return drain_main(rest)


def _cmd_etcd(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.cli.etcd import etcd_main

    return etcd_main(rest)


def _cmd_ckpt(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.checkpoint.cli import ckpt_main

    return ckpt_main(rest)


def _cmd_chaos(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.chaos.cli import chaos_main

    return chaos_main(rest)


def _cmd_grpo(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.grpo.__main__ import main as grpo_main

    return grpo_main(rest, prog="ftrt grpo")


def _cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.demo import demo_main

    return demo_main(rest)


def _cmd_rollout(args: argparse.Namespace, rest: list[str]) -> int:
    from ftrt.rollout.server import rollout_main

    return rollout_main(rest)


COMMANDS: dict[str, tuple[Handler, str]] = {
    "launch": (_cmd_launch, "run a training script on this node under an ftrt agent (torchrun drop-in)"),
    "status": (_cmd_status, "show a job's members, round, restarts and recent events"),
    "drain": (_cmd_drain, "make one node leave a job gracefully: ftrt drain --etcd HOST:PORT --job-id ID NODE"),
    "etcd": (_cmd_etcd, "run a local etcd server in the foreground (to try multi-node on one machine)"),
    "ckpt": (_cmd_ckpt, "list, inspect or verify checkpoints: ftrt ckpt ls|inspect|verify URL [STEP]"),
    "chaos": (_cmd_chaos, "chaos scenarios: ftrt chaos list | run FILE.yaml [--report DIR] [--seed N]"),
    "grpo": (_cmd_grpo, "train GRPO (one process, or under ftrt launch): ftrt grpo [--config F] [KEY=VALUE ...]"),
    "rollout": (_cmd_rollout, "serve rollouts for a job's trainer: ftrt rollout serve --etcd HOST:PORT --job-id ID"),
    "demo": (_cmd_demo, "the main demo: an elastic job on 3 local nodes that loses one and goes on"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftrt",
        description="Fault-tolerant distributed runtime and checkpoint service for RL post-training.",
    )
    parser.add_argument("--version", action="version", version=f"ftrt {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", help="logging level for ftrt's own messages (default INFO)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def setup_logging(level: str) -> None:
    """Plain, time-stamped ftrt log lines on stderr (workers' lines carry their own prefixes)."""
    numeric = getattr(logging, level.upper(), None)
    if not isinstance(numeric, int):
        raise FtrtError(f"--log-level {level!r} is not a logging level; use DEBUG, INFO or WARNING.")
    logging.basicConfig(
        level=numeric,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Everything after the subcommand belongs to it (``ftrt launch`` passes script args through).
    split = next((i for i, a in enumerate(argv) if a in COMMANDS), len(argv))
    args = parser.parse_args(argv[: split + 1])
    if args.command is None:
        parser.print_help()
        return 0
    try:
        setup_logging(args.log_level)
        handler, _ = COMMANDS[args.command]
        # An agent handles its own signals; every other command stops what it started.
        with contextlib.nullcontext() if args.command == "launch" else stop_cleanly():
            return handler(args, argv[split + 1:])
    except FtrtError as exc:
        print(f"ftrt: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        print(f"ftrt: {exc}" if isinstance(exc, Stopped) else "ftrt: interrupted", file=sys.stderr)
        return getattr(exc, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
