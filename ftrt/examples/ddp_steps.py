"""A tiny elastic DDP training script (gloo on CPU): the workload of the demo, tests and benches.

Runs unchanged under ``torchrun`` and ``ftrt launch``. Each step is a forward/backward/all-reduce
on a small MLP, padded with a sleep to about ``--step-time`` seconds. Rank 0 (or every rank with
``--all-ranks``) appends one JSON line per step to ``--progress`` (``time``, ``rank``, ``world``,
``step``, ``round``, ``pid``, and ``w``, a checksum of the weights after the step) so tests and benchmarks can see who stepped when at which world size.

Progress survives restarts through a small checkpoint (``--ckpt``, rank 0 writes it atomically
every ``--ckpt-every`` steps), so a restarted world continues from the last saved step instead of
step 0. With ``--boundary`` the script ends a round at a step boundary when ftrt asks (a node
joins or drains): the ranks agree on it through an all-reduce one step behind
(:class:`ftrt.roundend.RoundEndVote`), rank 0 saves that step, and every
worker exits (:meth:`ftrt.Runtime.round_ending`, :meth:`ftrt.Runtime.exit_for_round`), so the next
round redoes nothing whatever the checkpoint interval.

By default (``--no-in-place`` turns it off) the workers change rounds without exiting (:mod:`ftrt.inplace`): a lost peer
or a join raises :class:`ftrt.WorldChanged` in the step, the worker takes the new round
(:meth:`ftrt.Runtime.reconfigure`), the ranks agree on the newest step and its weights
(:func:`ftrt.sync_state`: a newcomer or a rank one step behind gets them) and the step in flight is
trained again at the new world size. Everything a worker can do before it knows its rank (build the
model, compile it with ``--compile`` and run it once) comes before ``rt.init_process_group``: a
node that joins a running job starts its workers before it is admitted, and they wait there, warm.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ftrt
from ftrt import RoundEndVote
from ftrt.inplace import allreduce_hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--progress", default=None, help="append per-step JSON lines here")
    p.add_argument("--all-ranks", action="store_true", help="every rank writes progress lines")
    p.add_argument("--ckpt", default=None, help="resume file (rank 0 writes the step every --ckpt-every steps)")
    p.add_argument("--ckpt-every", type=int, default=1, help="steps between two writes of --ckpt (default 1)")
    p.add_argument("--boundary", action="store_true",
                   help="end a round at a step boundary when ftrt asks (a join or a drain): save the step and exit")
    p.add_argument("--fail-at-step", type=int, default=-1, help="rank --fail-rank exits 1 at this step (once)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--hang-at-step", type=int, default=-1, help="rank --fail-rank stops heart-beating here")
    p.add_argument("--fail-when", default=None,
                   help="rank --fail-rank exits 1 at the step written in this file, once it exists")
    p.add_argument("--fault-marker", default=None,
                   help="file recording the injected fault (default: next to --ckpt); it fires once")
    p.add_argument("--teardown", type=float, default=0.0,
                   help="seconds of teardown after the last step (told to the agent with rt.done(): not a hang)")
    p.add_argument("--in-place", action=argparse.BooleanOptionalAction, default=True,
                   help="change rounds without exiting (rt.init_process_group, ftrt.WorldChanged, rt.reconfigure; "
                        "the default); --no-in-place: dist.init_process_group, so every round change restarts the "
                        "worker, as for a script that does not ask")
    p.add_argument("--wedge-on-change", type=int, default=-1, metavar="RANK",
                   help="this rank does not take its next round in place (it sleeps; once): the agent's "
                        "--reconfigure-timeout must replace it")
    p.add_argument("--fail-before-admission", action="store_true",
                   help="a worker started before its node's admission exits 1 before it is ready (once)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (the cost of a worker's start then includes compiling it)")
    p.add_argument("--plain", action="store_true",
                   help="hand-written data parallelism (all_reduce of gradients, manual SGD) instead of "
                        "DDP and torch.optim; these import torch._dynamo (2-3 s), which tests avoid")
    args = p.parse_args()

    rt = ftrt.init()
    marker = args.fault_marker or f"{args.ckpt or args.progress or 'x'}.failed-once"
    if args.fail_before_admission and rt.pending and not os.path.exists(marker + ".pending"):
        open(marker + ".pending", "w").close()
        os._exit(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = None if args.plain else torch.optim.SGD(net.parameters(), lr=0.01)
    compiled = torch.compile(net) if args.compile else net
    if args.compile:  # compile forward and backward before joining: a newcomer is warm when admitted
        compiled(torch.zeros(16, 32)).pow(2).mean().backward()
        net.zero_grad(set_to_none=True)
    if args.in_place:  # a node joining a running job waits here, warm, until it is admitted
        rt.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        with open(args.ckpt) as f:
            start = json.load(f)["step"] + 1
    if args.in_place:  # a newcomer takes the running ranks' weights and step
        start = agree(rt, start - 1, net, first=True) + 1
    model = wrap(compiled, rt, plain=args.plain)
    print(f"rank {rank} of {world} (round {rt.round}) starts at step {start}", flush=True)
    vote = RoundEndVote(rt) if args.boundary else None
    step, done = start, Done(start - 1)
    while step < args.steps:
        try:
            with rt.step():
                ending = train_step(args, rt, model, opt, vote, step, marker, done)
                # In place, only the ranks whose own node ends its round leave (a drain); the others
                # go on, and the next step's collective tells them the world changed.
                if ending and not (args.in_place and not rt.round_ending()):
                    rt.exit_for_round()  # the step is saved: the next round goes on from it
        except ftrt.WorldChanged as exc:
            print(f"rank {rank}: {exc}", flush=True)
            if rank == args.wedge_on_change and not os.path.exists(marker + ".wedged"):
                open(marker + ".wedged", "w").close()
                time.sleep(3600)
            vote = RoundEndVote(rt) if args.boundary else None  # its all-reduce in flight was on the old group
            step = agree(rt, done.step, net) + 1  # the step in flight again
            rank, world = rt.rank, rt.world_size
            done.step = step - 1
            model = wrap(compiled, rt, plain=args.plain)
            print(f"rank {rank} of {world} (round {rt.round}) goes on in place at step {step}", flush=True)
            continue
        step += 1
    if vote is not None:
        vote.close()
    dist.barrier()
    rt.done()
    time.sleep(args.teardown)
    dist.destroy_process_group()


def agree(rt: ftrt.Runtime, applied: int, net: torch.nn.Module, *, first: bool = False) -> int:
    """Take the new round (unless ``first``: the group is up already) and agree with the other ranks
    on the newest applied step and its weights (:func:`ftrt.sync_state`). A peer lost meanwhile (one
    more fault) replaces the round again: take that one too, until an agreement completes."""
    while True:
        try:
            if not first:
                rt.reconfigure()
            first = False
            with rt.step():  # its collectives wait with a bound; a failed one means the next round
                return ftrt.sync_state(applied, list(net.parameters()), wait=rt.wait)
        except ftrt.WorldChanged as exc:
            print(f"rank {rt.rank}: {exc} (while the ranks agreed on the state)", flush=True)


class Done:
    """The last step whose update this rank applied (a fault may come after the update and before
    the step's end)."""

    def __init__(self, step: int) -> None:
        self.step = step


def wrap(net: torch.nn.Module, rt: ftrt.Runtime, *, plain: bool) -> torch.nn.Module:
    """The model the steps train: DDP over the current process group, or (``--plain``) the net
    itself with its parameters broadcast from rank 0. In place, DDP's gradient all-reduce waits with
    a bound (:func:`ftrt.inplace.allreduce_hook`), so a frozen peer cannot hold it."""
    if plain:
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
        return net
    model = DDP(net)
    if rt.in_place:
        model.register_comm_hook(rt, allreduce_hook)
    return model


def train_step(args: argparse.Namespace, rt: ftrt.Runtime, model: torch.nn.Module, opt, vote, step: int,
               marker: str, done: Done) -> bool:
    """One step: a fault if one is due, forward/backward/update, heartbeat, checkpoint, progress line;
    True when the round ends after it (a join or drain the ranks agreed on)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    if args.fail_when and rank == args.fail_rank and os.path.exists(args.fail_when):
        with open(args.fail_when) as f:
            armed = f.read().strip()
        if armed and step >= int(armed):
            args.fail_at_step = step
    if step == args.fail_at_step and rank == args.fail_rank and not os.path.exists(marker):
        with open(marker, "w") as f:  # the fault's time, for benchmarks
            f.write(json.dumps({"time": time.time(), "step": step, "pid": os.getpid()}))
        os._exit(1)  # a crash: no interpreter teardown
    if step == args.hang_at_step and rank == args.fail_rank and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(json.dumps({"time": time.time(), "step": step, "pid": os.getpid()}))
        time.sleep(3600)
    x = torch.randn(16, 32)
    loss = model(x).pow(2).mean()
    if opt is not None:
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        model.zero_grad(set_to_none=False)
        loss.backward()
        with torch.no_grad():
            for prm in model.parameters():
                rt.wait(dist.all_reduce(prm.grad, async_op=True))  # in place: left if a peer froze
                prm -= 0.01 * prm.grad / world
    done.step = step
    rt.heartbeat(step)
    # Every rank sees the request at its own moment: agree on the step (one step behind, so
    # that no step waits on the agreement).
    ending = vote is not None and vote() and step + 1 < args.steps
    if rank == 0 and args.ckpt and ((step + 1) % args.ckpt_every == 0 or ending):
        tmp = f"{args.ckpt}.tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
        os.replace(tmp, args.ckpt)
    if args.progress and (rank == 0 or args.all_ranks):
        with open(args.progress, "a") as f:
            f.write(json.dumps({
                "time": time.time(), "rank": rank, "world": world, "step": step,
                "round": rt.round, "pid": os.getpid(),
                "w": float(sum(prm.detach().double().sum() for prm in model.parameters())),
            }) + "\n")
    spent = time.monotonic() - t0
    if spent < args.step_time and not ending:
        time.sleep(args.step_time - spent)
    return ending


if __name__ == "__main__":
    main()
