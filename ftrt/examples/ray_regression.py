"""A worker class for :class:`ftrt.integrations.ray.ElasticGroup`: linear regression trained data
parallel, one optimizer step per call, in the shape a Ray RL trainer's worker group has.

The driver owns the data: each call names the step and the global batch (sample ids), and each
rank trains on its share of it (``ids[rank::world]``) at whatever world size the group has when it
runs the step. The gradient is the sum over the batch divided by its size, so a step means the
same at any world size. A step the agreed state already holds is not trained again (the group may
run a call again after a world change: :mod:`ftrt.integrations.ray.worker`), so each step is
applied once and each sample is trained once per step. ``hold``: a folder where the rank says it
started the step and waits for ``go`` (tests use it to lose a node while a step is in flight).

    python -m ftrt.examples.ray_regression --nodes 3 --steps 20 --remove-at 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ftrt

DIM = 8


def sample(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The features and targets of samples ``ids``: a fixed function of each id."""
    g = torch.Generator().manual_seed(12345)
    true_w = torch.randn(DIM, 1, generator=g)
    xs = torch.stack([torch.randn(DIM, generator=torch.Generator().manual_seed(1000 + i)) for i in ids]) \
        if ids else torch.zeros(0, DIM)
    return xs, xs @ true_w


class Regression:
    """See the module docstring."""

    def __init__(self, lr: float = 0.05, seed: int = 0, step_time: float = 0.0) -> None:
        """``step_time``: seconds each step also spends (a stand-in for a real model's compute)."""
        self.step_time = step_time
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(DIM, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.step = -1
        """The last step applied."""
        self.rt = ftrt.init()

    def on_world_change(self) -> None:
        """Agree on the newest step and its weights (a newcomer, or a rank a step behind, gets them)."""
        params = [p.data for p in self.model.parameters()]
        self.step = ftrt.sync_state(self.step, params, wait=self.rt.wait)

    def _all_reduce(self, t: torch.Tensor) -> None:
        self.rt.wait(dist.all_reduce(t, async_op=True))

    def train(self, step: int, ids: list[int], hold: str | None = None) -> dict[str, Any]:
        """Apply step ``step`` on the batch ``ids``; what this rank trained."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if step <= self.step:
            return {"step": step, "ids": [], "rank": rank, "world": world, "loss": None, "skipped": True}
        if step != self.step + 1:
            raise ValueError(f"step {step} asked, but the state is at step {self.step}: steps are trained in order")
        mine = ids[rank::world]
        if hold:
            Path(hold, f"started-{os.getpid()}").touch()
            while not Path(hold, "go").exists():
                time.sleep(0.02)
        x, y = sample(mine)
        if self.step_time:
            time.sleep(self.step_time)
        self.opt.zero_grad()
        loss = ((self.model(x) - y) ** 2).sum()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()] + [loss.detach().reshape(1)])
        self._all_reduce(flat)
        flat /= len(ids)
        offset = 0
        for p in self.model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.opt.step()
        self.step = step
        return {"step": step, "ids": mine, "rank": rank, "world": world, "loss": flat[-1].item(), "skipped": False}

    def weights(self) -> list[float]:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).tolist()

    def pid(self) -> int:
        return os.getpid()

    def apply(self, fn: Any) -> Any:
        """``fn(self)`` on the worker: the driver's own code (a lambda travels too), e.g. to inspect."""
        return fn(self)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftrt.examples.ray_regression",
                                description="Train on an elastic Ray group of a local cluster, losing a node.")
    p.add_argument("--nodes", type=int, default=3, help="Ray worker nodes (raylets on this machine)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=12, help="samples per step")
    p.add_argument("--remove-at", type=int, default=8, help="remove a node before this step (-1: never)")
    args = p.parse_args(argv)
    import ray

    from ftrt.integrations.ray import ElasticGroup, loopback_cluster

    cluster = loopback_cluster(args.nodes)
    try:
        with ElasticGroup("ftrt.examples.ray_regression:Regression", min_nodes=1) as group:
            print(f"group ready: world {group.world_size}", flush=True)
            for step in range(args.steps):
                if step == args.remove_at:
                    victim = sorted(cluster.worker_nodes, key=lambda n: n.unique_id)[-1]
                    cluster.remove_node(victim)
                    print(f"removed a Ray node before step {step}", flush=True)
                t0 = time.monotonic()
                res = group.call("train", step, list(range(step * args.batch, (step + 1) * args.batch)))
                losses = [v["loss"] for v in res.values if not v["skipped"]]
                print(f"step {step:3d}  world {res.world_size}  loss {losses[0]:.4f}  "
                      f"{(time.monotonic() - t0) * 1000:.0f} ms", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
