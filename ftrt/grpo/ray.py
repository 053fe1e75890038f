"""The GRPO trainer as a single-controller Ray program: ``python -m ftrt.grpo.ray [KEY=VALUE ...]``.

The driver owns the loop and the data, in the shape veRL's and OpenRLHF's drivers have: each step
it takes the next ``prompts_per_step`` prompts, has the policy workers generate and score them
(``generate``), computes the group advantages, and has the workers update the policy on the whole
rollout (``update``); rank 0's metrics line is written here, not by a worker. The workers are an
elastic group (:class:`ftrt.integrations.ray.ElasticGroup` of :class:`ftrt.grpo.ray_worker.PolicyWorker`),
so a Ray node lost mid-step costs the step's call one more attempt at the smaller world, and a node
added joins at a step's start; the driver's data split follows the world size of the round that
ran each call, so no prompt is lost or trained twice.

It learns as ``ftrt launch -m ftrt.grpo`` does: the same config (:class:`ftrt.grpo.config.GRPOConfig`,
``rollout.mode=local``), the same shares, seeds and update, so at the same world size the two write
the same rewards and losses. Checkpoints (``checkpoint.url``) are written when the driver's cadence
says so (``checkpoint.interval``, ``auto`` too) and at the end; a driver started again resumes
from the newest. Not a drop-in for every trainer field: the rollout fleet and ``ftrt launch``'s
memory tier belong to the launched trainer.

    python -m ftrt.grpo.ray --local-nodes 3 --remove-node-at 10 steps=30 prompts_per_step=8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import torch

from ftrt import progress
from ftrt.errors import ConfigError, FtrtError
from ftrt.grpo import runconfig
from ftrt.grpo.config import GRPOConfig
from ftrt.grpo.loss import group_advantages
from ftrt.grpo.salvage import shard

WORKER = "ftrt.grpo.ray_worker:PolicyWorker"


class Driver:
    """The single controller (see the module docstring): ``group`` is an elastic group of
    :data:`WORKER` built from ``cfg``; ``before_step(step)`` runs before each step (the demo's and
    the tests' faults)."""

    def __init__(self, cfg: GRPOConfig, group: Any, *, before_step: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        check_config(cfg)
        from ftrt.grpo.trainer import Metrics

        self.cfg, self.group, self.clock = cfg, group, clock
        self.before_step = before_step or (lambda step: None)
        self.metrics = Metrics(cfg.metrics_path)
        self.cadence = _cadence(cfg) if cfg.checkpoint.url else None
        self.faults = 0
        """World shrinks the driver saw (the cadence's fault count)."""

    def run(self) -> dict[str, Any]:
        """Train from the agreed position to ``cfg.steps``; return the summary."""
        cfg = self.cfg
        pos = next(v for v in self.group.call("position").values if v is not None)
        start, frontier = pos["step"], pos["frontier"]
        if cfg.checkpoint.url:
            runconfig.record_once_started(cfg)
        dropped = self.metrics.rewind(start)
        if self.cadence is not None:
            self.cadence.saved(start, measured=False)
        print(f"[ftrt.grpo.ray] task {cfg.task.name} {cfg.task.params}, {pos['params']:,} parameters, "
              f"{cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples, world size "
              f"{self.group.world_size}" + (f"; resumed at step {start} ({dropped} uncommitted line(s) dropped)"
                                            if start else ""), flush=True)
        t0, rewards, world, cost = self.clock(), [], self.group.world_size, None
        with progress.bar(cfg.steps, "GRPO", "step", mode=cfg.progress, initial=min(start, cfg.steps)) as bar:
            for step in range(start, cfg.steps):
                self.before_step(step)
                record = self._step(step, frontier)
                frontier += cfg.prompts_per_step
                if record["world_size"] < world:
                    self.faults += 1
                world = record["world_size"]
                rewards.append(record["reward_mean"])
                if self.cadence is not None:
                    self.cadence.update(step_s=record["step_s"], save_cost_s=cost, faults=self.faults,
                                        elapsed_s=self.clock() - t0)
                    cost = None
                    if self.cadence.due(step + 1) or step + 1 == cfg.steps:
                        cost = self._save(step + 1)
                        record["ckpt"] = "storage"
                self.metrics.append(record)
                bar.set_postfix({"reward": f"{record['reward_mean']:.3f}", "world": world}, refresh=False)
                bar.update(1)
        last = rewards[-10:]
        summary = {"steps": cfg.steps, "final_reward": sum(last) / len(last) if last else None,
                   "world_size": world, "wall_s": self.clock() - t0, "faults": self.faults}
        if last:
            print(f"[ftrt.grpo.ray] done: {cfg.steps} steps, mean reward of the last {len(last)} steps "
                  f"{summary['final_reward']:.3f}, {summary['wall_s']:.1f} s, world size {world}", flush=True)
        self.group.call("finish")
        return summary

    def _step(self, step: int, frontier: int) -> dict[str, Any]:
        """Generate, score and train step ``step`` on prompts ``[frontier, frontier + prompts_per_step)``."""
        cfg = self.cfg
        t0 = self.clock()
        prompt_ids = list(range(frontier, frontier + cfg.prompts_per_step))
        groups = self._generate(step, prompt_ids)
        t_gen = self.clock()
        rewards = torch.stack([groups[pid][1] for pid in prompt_ids])
        adv = group_advantages(rewards, cfg.adv_std_norm)
        tokens = float(sum(groups[pid][2] for pid in prompt_ids))
        scored = [(pid, groups[pid][0], adv[i].clone()) for i, pid in enumerate(prompt_ids)]  # a view would carry all rows
        res = self.group.call("update", step, scored, tokens)
        done = next(v for v in res.values if v is not None)
        step_s = self.clock() - t0
        # Summed as the launched trainer sums it (each rank's share in float32, then over the ranks).
        world = done["world_size"]
        reward_sum = sum(float(rewards[slice(*shard(len(prompt_ids), world, r))].sum()) for r in range(world))
        return {"step": step, "reward_mean": reward_sum / rewards.numel(), "loss": done["loss"],
                "kl": done["kl"], "grad_norm": done["grad_norm"], "world_size": done["world_size"],
                "prompt_ids": prompt_ids, "tokens_per_s": tokens / step_s, "time": time.time(), "step_s": step_s,
                "generate_s": t_gen - t0, "update_s": step_s - (t_gen - t0), "round": done["round"], "ckpt": None}

    def _generate(self, step: int, prompt_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
        """Every prompt's group of step ``step``: asked again for prompts whose rank's reply was lost
        with its node after it generated them (the call's ``missing`` ranks)."""
        got: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        need = prompt_ids
        while need:
            res = self.group.call("generate", step, need)
            for value in res.values:
                for pid, completions, rewards, tokens in value or ():
                    got[pid] = (completions, rewards, tokens)
            left = [pid for pid in need if pid not in got]
            if len(left) == len(need):
                raise FtrtError(f"No worker generated step {step}'s prompts {left[:8]}...: the group lost every "
                                "reply twice.")
            need = left
        return got

    def _save(self, step: int) -> float:
        """A storage checkpoint of the state after ``step - 1`` steps; its cost (the slowest rank's)."""
        res = self.group.call("save", step)
        assert self.cadence is not None
        self.cadence.saved(step)
        return max(v for v in res.values if v is not None)


def check_config(cfg: GRPOConfig) -> None:
    """Refuse what the Ray driver does not do (before any cluster or group is started)."""
    if cfg.rollout.mode != "local":
        raise ConfigError("Config field 'rollout.mode' = fleet: the Ray driver's workers sample locally; "
                          "use ftrt launch -m ftrt.grpo for the rollout fleet.")


def _cadence(cfg: GRPOConfig) -> Any:
    """The storage tier's cadence (``checkpoint.interval``; ``auto``: Young/Daly from the measured save
    cost and ``checkpoint.mtbf``, or the faults the driver saw)."""
    from ftrt.checkpoint.cadence import Cadence, estimate_mtbf

    c = cfg.checkpoint

    def say(tier: str, choice: Any) -> None:
        print(f"[ftrt.grpo.ray] {tier} checkpoints every {choice.seconds:.2f} s of training: {choice.reason}",
              flush=True)

    return Cadence("storage", c.interval, max_interval_s=c.max_interval_s,
                   mtbf=lambda faults, elapsed: estimate_mtbf(c.mtbf, faults, elapsed), on_choice=say)


def main(argv: list[str] | None = None, prog: str = "python -m ftrt.grpo.ray") -> int:
    from ftrt.grpo.config import add_arguments, help_text, load_config

    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Train GRPO from one Ray driver on an elastic group of policy workers (docs/ray.md).",
        epilog="Example: python -m ftrt.grpo.ray --local-nodes 3 --remove-node-at 10 steps=30 "
               "prompts_per_step=8. --help-config lists every config field.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="the Ray cluster to join (ray.init's address, e.g. auto)")
    where.add_argument("--local-nodes", type=int, metavar="N",
                       help="start a Ray cluster of N raylets on this machine's loopback (a demo, tests)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="policy workers per Ray node")
    p.add_argument("--min-nodes", type=int, default=1, help="the fewest nodes the group trains on")
    p.add_argument("--max-nodes", type=int, help="the most nodes (default: the nodes there are at the start)")
    p.add_argument("--etcd", help="the job's etcd HOST:PORT (default: the group starts one, on loopback only)")
    p.add_argument("--remove-node-at", type=int, action="append", default=[], metavar="STEP",
                   help="with --local-nodes: remove a Ray node before this step (a fault, to watch the group go on)")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.help_config:
        print(help_text())
        return 0
    if args.remove_node_at and not args.local_nodes:
        p.error("--remove-node-at needs --local-nodes (it removes a raylet of the cluster this command started)")
    for name in ("local_nodes", "nproc_per_node", "min_nodes", "max_nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    try:
        cfg = load_config(args.config, args.overrides)
        check_config(cfg)
        if cfg.checkpoint.url:
            runconfig.check_before_start(cfg)
        return _run(cfg, args)
    except FtrtError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _run(cfg: GRPOConfig, args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        raise ConfigError("python -m ftrt.grpo.ray needs Ray: pip install 'ftrt[ray]'.") from None
    from ftrt.integrations.ray import ElasticGroup, loopback_cluster

    cluster = loopback_cluster(args.local_nodes) if args.local_nodes else None
    if cluster is None:
        ray.init(address=args.address, log_to_driver=False)
    removals = sorted(args.remove_node_at)

    def before_step(step: int) -> None:
        while removals and removals[0] <= step and cluster is not None:
            removals.pop(0)
            nodes = sorted(cluster.worker_nodes, key=lambda n: n.unique_id)
            if len(nodes) <= args.min_nodes:
                print(f"[ftrt.grpo.ray] not removing a node before step {step}: {len(nodes)} left "
                      f"(--min-nodes {args.min_nodes})", flush=True)
                return
            cluster.remove_node(nodes[-1])
            print(f"[ftrt.grpo.ray] removed a Ray node before step {step}", flush=True)

    if cfg.checkpoint.url and "://" not in cfg.checkpoint.url:  # the workers' folder is not the driver's
        cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
            update={"url": os.path.abspath(cfg.checkpoint.url)})})
    try:
        with ElasticGroup(WORKER, nproc_per_node=args.nproc_per_node, min_nodes=args.min_nodes,
                          max_nodes=args.max_nodes, args=(cfg.model_dump(),), etcd=args.etcd) as group:
            Driver(cfg, group, before_step=before_step).run()
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
