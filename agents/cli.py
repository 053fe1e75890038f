"""``ftrt launch``: the command line of one agent, a drop-in for torchrun.

torchrun's spellings are accepted as aliases (``--rdzv-endpoint``, ``--rdzv-id``,
``--nproc_per_node``, underscores for dashes), so an existing torchrun command line needs only its
first word changed. Options that only make sense for torchrun's own rendezvous backends
(``--rdzv-backend``, ``--rdzv-conf``) are accepted and ignored with a note. Each flag is written once,
in :mod:`ftrt.agents.launch_flags`; the parser and the flags -> config conversion here are built from it.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from ftrt.agents.launch_flags import FLAGS, IGNORED
from ftrt.errors import ConfigError

if TYPE_CHECKING:  # the config module imports pydantic; keep it off the fast start path
    from ftrt.agents.config import LaunchConfig

log = logging.getLogger(__name__)


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ftrt launch``, built from :data:`~ftrt.agents.launch_flags.FLAGS`."""
    p = argparse.ArgumentParser(
        prog="ftrt launch",
        description="Run SCRIPT (or -m MODULE) on this node under an ftrt agent, torchrun-compatibly.",
        allow_abbrev=False,  # the script's own flags follow it: `train.py --n 3` is the script's, not ambiguous
    )
    for flag in FLAGS:
        flag.add_to(p)
    for names in IGNORED:
        p.add_argument(*names, dest=_dest(names[0]), default=None, help=argparse.SUPPRESS)
    p.add_argument("-m", "--module", dest="is_module", action="store_true",
                   help="run TARGET as a module (python -m)")
    p.add_argument("target", nargs="?", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_launch_args(argv: list[str]) -> "LaunchConfig":
    """Turn ``ftrt launch`` arguments into a validated :class:`LaunchConfig`."""
    return config_from_namespace(build_parser().parse_args(argv))


def config_from_namespace(ns: argparse.Namespace) -> "LaunchConfig":
    """Validate parsed ``ftrt launch`` arguments into a :class:`LaunchConfig`."""
    from ftrt.agents.config import load_config

    if ns.target is None:
        raise ConfigError("Give the training script to run (or -m MODULE), e.g. ftrt launch train.py.")
    for names in IGNORED:
        if getattr(ns, _dest(names[0])):
            log.info("%s is a torchrun option and is ignored: ftrt's rendezvous is etcd", names[0])
    values = {"module" if ns.is_module else "script": ns.target, "script_args": tuple(ns.args)}
    for flag in FLAGS:
        values.update(flag.from_args(ns))
    return load_config(**values)


def check_module(module: str) -> None:
    """Refuse ``-m module`` when no worker could import its top-level package or module: a worker
    starts in this folder, which ``python -m`` puts first on its path. Found without importing
    anything (a package's own imports may be heavy); a missing submodule shows in the workers."""
    import importlib.util
    import os
    import sys

    top = module.split(".")[0]
    if top in sys.builtin_module_names or top in sys.modules:
        return
    sys.path.insert(0, os.getcwd())  # every finder, editable installs' too; a top-level name imports nothing
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.remove(os.getcwd())
    if not found:
        raise ConfigError(f"-m {module}: no module {top!r} here ({os.getcwd()}) or on this Python's path, where "
                          "the workers would look; check the name, or install it.")


def launch_main(argv: list[str]) -> int:
    from ftrt.agents.workers.early import EarlyStart
    from ftrt.agents.workers.warmup import warm_imports_for

    ns = build_parser().parse_args(argv)
    early = None
    if ns.target is not None and ns.warm_workers and 1 <= ns.nproc_per_node <= 1024:
        # Spares start now, before the imports below: see ftrt.agents.workers.early.
        early = EarlyStart.begin(
            nproc=ns.nproc_per_node, warm=True,
            warm_imports=tuple(ns.warm_imports) if ns.warm_imports else
            warm_imports_for(ns.target if ns.is_module else None),
        )
    try:
        cfg = config_from_namespace(ns)
        if cfg.module is not None:
            check_module(cfg.module)
        from ftrt.agents.agent import run_agent
    except BaseException:
        if early is not None:
            early.discard()
        raise
    return run_agent(cfg, early)
