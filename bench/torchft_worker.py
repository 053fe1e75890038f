"""One torchft replica group of one process: the training script of the recovery bench's torchft baseline.

Run under ``python -m torch.distributed.run --nproc-per-node 1`` with ``REPLICA_GROUP_ID`` and
``TORCHFT_LIGHTHOUSE`` set, as torchft's own examples run (:mod:`bench.torchft_baseline` starts it).
The workload is ``ftrt/examples/ddp_steps.py --plain``'s: a small MLP seeded with 0, a batch of
``randn(16, 32)``, ``out.pow(2).mean()``, SGD with lr 0.01, each step padded with a sleep to about
``--step-time`` seconds.

Each step asks torchft's ``Manager`` for a quorum, averages every gradient across the replica
groups of that quorum with ``manager.allreduce`` and steps the optimizer only if
``manager.should_commit()``: an error in the step (a peer lost mid-allreduce) makes torchft drop the
step, and the next one runs in a new quorum. torchft's ``DistributedDataParallel`` wrapper is not
used: a kill landing mid-allreduce crashed the survivor in its comm hook (docs: deps.md). A group
that (re)joins heals in its first quorum: it receives a live peer's model, optimizer and step over
the process group (the state callbacks below), as torchft does by default with its ``PGTransport``.

For each committed step the group appends a JSON line to ``--progress``, the fields of
``ddp_steps.py``'s lines so that :class:`ftrt.chaos.local.StepLog` reads both:

- ``rank``: the replica group id (``REPLICA_GROUP_ID``);
- ``world``: the replica groups that took part in the step's quorum (``manager.num_participants()``;
  a group healing in that step is not counted: it contributes no gradient);
- ``step``: torchft's number for the step (the manager's current step while it trains, from 0);
- ``round``: the id of the step's quorum;
- ``time``, ``pid``, and ``w``, a checksum of the weights after the step (equal on every group that
  committed the same step, a healed one included).

``--fail-when``/``--fail-rank``/``--fault-marker`` inject a crash as ``ddp_steps.py`` does. Options the
bench passes to ``ddp_steps.py`` that have no meaning here are accepted and ignored (see their help).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from datetime import timedelta

import torch
import torchft.manager
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

log = logging.getLogger("bench.torchft_worker")

LOOPBACK = "127.0.0.1"
PG_TIMEOUT = timedelta(seconds=5)
"""Bounds a collective, the process group's reconfiguration and the transfer of a healing
checkpoint. A killed peer closes its sockets, so it only matters for a frozen one; torchft's
``train_ddp.py`` uses 5 s for gloo."""
MANAGER_TIMEOUT = timedelta(seconds=30)
"""Bounds the manager's RPCs (``should_commit``, checkpoint metadata): torchft's ``train_ddp.py`` value."""


def main() -> None:
    args = parse_args()
    group = int(os.environ["REPLICA_GROUP_ID"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [replica={group}] %(name)s: %(message)s")
    for structured in ("torchft_quorums", "torchft_commits", "torchft_errors"):
        # Records for torchft's OpenTelemetry export, their data in ``extra``: empty lines in a plain log.
        logging.getLogger(structured).setLevel(logging.WARNING)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = torch.compile(net) if args.compile else net
    if args.compile:  # compile forward and backward before joining a quorum, as ddp_steps.py does
        model(torch.zeros(16, 32)).pow(2).mean().backward()
        opt.zero_grad(set_to_none=True)

    manager = make_manager(group, net, opt)
    marker = args.fault_marker or f"{args.ckpt or args.progress or 'x'}.failed-once"
    while manager.current_step() < args.steps:
        t0 = time.monotonic()
        maybe_fail(args, group, manager.current_step(), marker)
        if train_step(manager, model, net, opt) and args.progress:
            write_progress(args.progress, group, manager, net)
        spent = time.monotonic() - t0
        if spent < args.step_time:
            time.sleep(args.step_time - spent)
    manager.shutdown()


def make_manager(group: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Manager:
    """Replica group ``group``'s torchft manager at the bench's settings (module docstring): a gloo
    group bounded by :data:`PG_TIMEOUT`, and a newcomer healing ``model`` and ``opt`` from a live
    peer over it (``PGTransport``)."""

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    _bind_manager_server_to_loopback()
    pg = ProcessGroupGloo(timeout=PG_TIMEOUT)
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"bench_{group}", hostname=LOOPBACK, timeout=MANAGER_TIMEOUT,
        checkpoint_transport=PGTransport(pg, timeout=PG_TIMEOUT, device=torch.device("cpu")),
    )
    log.info("replica group %d starts (pid %d)", group, os.getpid())
    return manager


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="train until the manager's step reaches this")
    p.add_argument("--step-time", type=float, default=0.05, help="each step is padded with a sleep to this (s)")
    p.add_argument("--progress", default=None, help="append a JSON line per committed step here")
    p.add_argument("--fail-when", default=None,
                   help="replica group --fail-rank exits 1 at the step written in this file, once it exists")
    p.add_argument("--fail-rank", type=int, default=0, help="the replica group id that --fail-when crashes")
    p.add_argument("--fault-marker", default=None,
                   help="file recording the injected fault (default: next to --ckpt); it fires once")
    p.add_argument("--compile", action="store_true", help="run the forward through torch.compile")
    p.add_argument("--all-ranks", action="store_true",
                   help="ignored: every replica group writes progress lines (each is one process)")
    p.add_argument("--plain", action="store_true", help="ignored: gradients are always all-reduced by hand")
    p.add_argument("--ckpt", default=None,
                   help="ignored, but names the default --fault-marker: a group heals from a live peer")
    p.add_argument("--ckpt-every", type=int, default=1, help="ignored (no checkpoint file is written)")
    p.add_argument("--boundary", action="store_true", help="ignored: torchft has no round to end")
    return p.parse_args()


def maybe_fail(args: argparse.Namespace, group: int, step: int, marker: str) -> None:
    """Crash (exit 1, no teardown) if this is the group to fail, the step armed in ``--fail-when``
    has come, and the fault has not fired yet; record its time in ``marker`` first."""
    if not args.fail_when or group != args.fail_rank or os.path.exists(marker):
        return
    try:
        with open(args.fail_when) as f:
            armed = f.read().strip()
    except FileNotFoundError:
        return
    if armed and step >= int(armed):
        with open(marker, "w") as f:  # the fault's time, for benchmarks
            f.write(json.dumps({"time": time.time(), "step": step, "pid": os.getpid()}))
        os._exit(1)


def train_step(manager: Manager, model: torch.nn.Module, net: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Forward, backward, the gradients averaged over the quorum, and the update if torchft commits
    the step (True). The quorum is computed while the forward and backward run."""
    manager.start_quorum()
    opt.zero_grad()
    model(torch.randn(16, 32)).pow(2).mean().backward()
    # Wait on every reduction before the commit vote: a failed one is reported to the manager,
    # which then votes against committing.
    for work in [manager.allreduce(prm.grad) for prm in net.parameters()]:
        work.wait()
    if not manager.should_commit():
        log.info("step %d not committed (quorum %d)", manager.current_step(), manager._quorum_id)
        return False
    opt.step()
    return True


def write_progress(path: str, group: int, manager: Manager, net: torch.nn.Module) -> None:
    """One line for the step just committed (the manager has counted it already)."""
    with open(path, "a") as f:
        f.write(json.dumps({
            "time": time.time(), "rank": group, "world": manager.num_participants(),
            "step": manager.current_step() - 1,
            "round": manager._quorum_id,  # torchft 0.2.0 has no public accessor for the quorum id
            "pid": os.getpid(),
            "w": float(sum(prm.detach().double().sum() for prm in net.parameters())),
        }) + "\n")


def _bind_manager_server_to_loopback() -> None:
    """torchft 0.2.0's ``Manager`` binds its server to every interface (``[::]:port``, fixed in its
    constructor); the bench keeps every socket on loopback, so give it a loopback address instead."""
    server = torchft.manager.ManagerServer

    def loopback_server(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[1]
        return server(**{**kwargs, "bind": f"{LOOPBACK}:{port}"})

    torchft.manager.ManagerServer = loopback_server


if __name__ == "__main__":
    main()
