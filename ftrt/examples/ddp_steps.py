"""A tiny elastic DDP training script (gloo on CPU): the workload of the demo, tests and benches.

Runs unchanged under ``torchrun`` and ``ftrt launch``. Each step is a forward/backward/all-reduce
on a small MLP, padded with a sleep to about ``--step-time`` seconds. Rank 0 (or every rank with
``--all-ranks``) appends one JSON line per step to ``--progress`` (``time``, ``rank``, ``world``,
``step``, ``round``, ``pid``) so tests and benchmarks can see who stepped when at which world size.

Progress survives restarts through a small checkpoint (``--ckpt``, rank 0 writes it atomically
every ``--ckpt-every`` steps), so a restarted world continues from the last saved step instead of
step 0. With ``--boundary`` the script ends a round at a step boundary when ftrt asks (a node
joins or drains): the ranks agree on it through an all-reduce one step behind
(:class:`ftrt.roundend.RoundEndVote`), rank 0 saves that step, and every
worker exits (:meth:`ftrt.Runtime.round_ending`, :meth:`ftrt.Runtime.exit_for_round`), so the next
round redoes nothing whatever the checkpoint interval.
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
    p.add_argument("--plain", action="store_true",
                   help="hand-written data parallelism (all_reduce of gradients, manual SGD) instead of "
                        "DDP and torch.optim; these import torch._dynamo (2-3 s), which tests avoid")
    args = p.parse_args()

    rt = ftrt.init()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if args.plain:
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
        model, opt = net, None
    else:
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        with open(args.ckpt) as f:
            start = json.load(f)["step"] + 1
    print(f"rank {rank} of {world} (round {rt.round}) starts at step {start}", flush=True)
    marker = args.fault_marker or f"{args.ckpt or args.progress or 'x'}.failed-once"
    vote = RoundEndVote(rt) if args.boundary else None
    for step in range(start, args.steps):
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
                    dist.all_reduce(prm.grad)
                    prm -= 0.01 * prm.grad / world
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
                }) + "\n")
        if ending:
            rt.exit_for_round()  # the step is saved: the next round goes on from it
        spent = time.monotonic() - t0
        if spent < args.step_time:
            time.sleep(args.step_time - spent)
    if vote is not None:
        vote.close()
    dist.barrier()
    rt.done()
    time.sleep(args.teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
