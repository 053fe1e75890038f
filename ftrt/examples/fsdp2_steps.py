"""FSDP2 training that changes rounds in place: the sharded state comes back from memory checkpoints.

``ftrt launch --nnodes 1:2 --nproc-per-node 1 -m ftrt.examples.fsdp2_steps --ckpt DIR --steps 60``

A data-parallel loop can hand a newcomer the state from any live rank (:func:`ftrt.sync_state`),
but under FSDP2 each rank holds a shard only, and a lost node's shards exist nowhere else but in
its memory checkpoints' replicas on its peers (``--replicas``). So when the world changes this
script keeps its process (its interpreter, imports, CUDA context and communicators on a GPU:
what a restart pays again), takes the new round (:meth:`ftrt.Runtime.reconfigure`), shards a
fresh module over the new world and restores the newest memory checkpoint into it, resharded
(the survivors' own shards and the replicas of the lost ones; ``ck.restore``). With a memory
checkpoint after every step, at most the step in flight is trained again.

Each step trains the global batch of ``--batch`` samples drawn from the step's seed, split across
the ranks, with the loss normalised by the global batch, so every world size trains the same
update up to float summation order. Rank 0 appends a line per step to ``--progress`` (``step``,
``world``, ``round``, ``pid``, ``loss`` and ``w``, the sum of the full weights). FSDP2's own
collectives wait without a bound: a frozen peer is left by the agent's ``--reconfigure-timeout``,
which replaces the worker (a restart), not in place.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ftrt


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded over ``world`` ranks (the same initial weights on every rank) and its AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def weight_sum(model: torch.nn.Module) -> float:
    """The sum of the full (unsharded) weights: a collective, every rank calls it."""
    total = 0.0
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        total += float(full.detach().double().sum())
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=24, help="global batch (samples per step)")
    p.add_argument("--ckpt", required=True, help="checkpoint URL (storage); memory checkpoints every step")
    p.add_argument("--persist-every", type=int, default=20, help="steps between two storage saves")
    p.add_argument("--step-time", type=float, default=0.0, help="pad each step to this many seconds")
    p.add_argument("--progress", default=None, help="rank 0 appends a JSON line per step here")
    args = p.parse_args()

    rt = ftrt.init()
    rt.init_process_group("gloo")
    model, opt, ck, step = enter(rt, args)
    saving = None
    while step < args.steps:
        try:
            with rt.step():
                t0 = time.monotonic()
                loss = train_step(model, opt, step, args.batch, saving)
                w = weight_sum(model)
                if args.progress and dist.get_rank() == 0:  # before the save: a step restored has its line
                    with open(args.progress, "a") as f:
                        f.write(json.dumps({"time": time.time(), "step": step, "world": dist.get_world_size(),
                                            "round": rt.round, "pid": os.getpid(), "loss": loss, "w": w}) + "\n")
                saving = ck.save(step + 1, {"model": model, "optim": opt, "trainer": {"step": step + 1}},
                                 persist=(step + 1) % args.persist_every == 0 or step + 1 == args.steps)
                rt.heartbeat(step + 1)
                step += 1
                if (spent := time.monotonic() - t0) < args.step_time:
                    time.sleep(args.step_time - spent)
        except ftrt.WorldChanged as exc:
            print(f"rank {dist.get_rank() if dist.is_initialized() else '?'}: {exc}", flush=True)
            ck.retire()  # its groups and round fence belong to the old round
            while True:  # one more fault while the state comes back: the next round
                try:
                    rt.reconfigure()
                    with rt.step():
                        model, opt, ck, step = enter(rt, args)
                    saving = None
                    break
                except ftrt.WorldChanged as again:
                    print(f"rank {rt.rank}: {again} (while restoring)", flush=True)
            print(f"rank {rt.rank} of {rt.world_size} (round {rt.round}) goes on in place at step {step}", flush=True)
    ck.close()
    rt.done()
    dist.destroy_process_group()


def enter(rt: ftrt.Runtime, args: argparse.Namespace):
    """This round's model, optimizer and checkpointer, and the step the restored state holds."""
    model, opt = build(dist.get_world_size())
    ck = rt.checkpointer(args.ckpt)
    state = {"model": model, "optim": opt, "trainer": {"step": 0}}
    try:
        ck.restore(state)
    except BaseException:
        ck.retire()  # a peer lost while restoring: this round's checkpointer goes with it
        raise
    return model, opt, ck, int(state["trainer"]["step"])


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch: int, saving) -> float:
    """One step on this rank's share of the step's global batch (``saving``: the last step's save,
    which must have copied the weights before the optimizer changes them); returns the global loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(batch, 32, generator=g), torch.randn(batch, 1, generator=g)
    base, extra = divmod(batch, world)
    lo = rank * base + min(rank, extra)
    hi = lo + base + (1 if rank < extra else 0)
    opt.zero_grad()
    # FSDP2 averages gradients over the ranks: scale the local sum so the mean is the global one.
    loss = (model(x[lo:hi]) - y[lo:hi]).pow(2).sum() * world / batch
    loss.backward()
    if saving is not None:
        saving.wait_staged()
    opt.step()
    total = loss.detach() / world
    dist.all_reduce(total)
    return float(total)


if __name__ == "__main__":
    main()
