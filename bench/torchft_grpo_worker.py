"""One torchft replica group of one process training ftrt's GRPO job: the goodput bench's torchft baseline.

Run under ``python -m torch.distributed.run --nproc-per-node 1`` with ``REPLICA_GROUP_ID`` and
``TORCHFT_LIGHTHOUSE`` set (:class:`bench.torchft_baseline.TorchftCluster` starts it), with the
GRPO config as ``KEY=VALUE`` arguments, as ``python -m ftrt.grpo`` takes them. The step is the
built-in trainer's (:mod:`ftrt.grpo.trainer`) on the same task, policy and seeds, so the two
systems do the same work per step:

- step ``s`` trains the global prompts ``[s * P, (s + 1) * P)``: torchft's step counter is the
  ledger (a step is committed on every participant or on none);
- the quorum's participants split the prompts as the trainer's ranks do (:func:`~ftrt.grpo.trainer.shard`)
  and sample them locally with the seeds of :mod:`ftrt.policy.sample`;
- token and sequence counts, then the gradients and the step's sums are summed over the quorum
  (``manager.allreduce(..., reduce_op=SUM)``: torchft 0.2.0 averages by default); a replica group
  that heals in this step contributes zeros (torchft zeroes its tensors);
- the optimizer steps only if ``manager.should_commit()``: a peer lost mid-step makes torchft drop
  the step, and the next quorum trains it again.

A (re)joining group heals from a live peer's model and AdamW state over the process group
(``PGTransport``), torchft's default; no checkpoint is written (torchft recovers from live peers).
The participant of rank 0 appends one line per committed step to ``metrics_path`` in the GRPO
trainer's format (step, step_s, time, world_size, prompt_ids, redone = resumes = 0), which the
goodput bench reads as it reads ftrt's and torchrun's. A step's ``step_s`` runs from its quorum's
answer to its commit: the wait for a quorum (after a fault, the lighthouse's heartbeat timeout) is
not productive time, as ftrt's trainer does not count a round change in its steps.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
from torch.distributed import ReduceOp
from torchft import Manager

from bench.torchft_worker import make_manager
from ftrt.grpo.config import GRPOConfig, load_config
from ftrt.grpo.loss import aggregate, clipped_surrogate, group_advantages, k3_kl
from ftrt.grpo.trainer import shard
from ftrt.policy.sample import rollout, token_logps
from ftrt.policy.setting import build_setting

log = logging.getLogger("bench.torchft_grpo_worker")


def main(argv: list[str]) -> None:
    cfg = load_config(None, argv)
    group = int(os.environ["REPLICA_GROUP_ID"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [replica={group}] %(name)s: %(message)s")
    for structured in ("torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(structured).setLevel(logging.WARNING)
    torch.set_num_threads(cfg.threads)
    built = build_setting(cfg.model, cfg.task, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens)
    model = built.model
    ref = None
    if cfg.kl_beta > 0:
        import copy

        ref = copy.deepcopy(model).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    manager = make_manager(group, model, opt)
    while manager.current_step() < cfg.steps:
        manager.start_quorum()
        line = train_step(cfg, manager, built, model, ref, params, opt)
        if line is not None and cfg.metrics_path:
            with open(cfg.metrics_path, "a") as f:
                f.write(json.dumps(line) + "\n")
    manager.shutdown()


def train_step(cfg: GRPOConfig, manager: Manager, built, model: torch.nn.Module, ref: torch.nn.Module | None,
               params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> dict | None:
    """One GRPO step in this quorum; the metrics line of a committed step on participant 0, else None."""
    world = manager.num_participants()  # waits for the quorum
    t0 = time.perf_counter()  # the step's own time from here, as ftrt's trainer counts it after a round change
    rank = manager.participating_rank()  # None: this group heals in this step
    step = manager.current_step()
    frontier = step * cfg.prompts_per_step
    lo, hi = shard(cfg.prompts_per_step, world, rank) if rank is not None else (0, 0)
    mine = list(range(frontier + lo, frontier + hi))
    batch = rollout(model, built.task, built.vocab, seed=cfg.seed, step=step, prompt_ids=mine, group=cfg.group_size,
                    max_new=built.max_new, temperature=cfg.temperature)
    counts = torch.tensor([float(batch.mask.sum()), float(batch.mask.shape[0])], dtype=torch.float64)
    manager.allreduce(counts, reduce_op=ReduceOp.SUM).wait()
    total_tokens, total_seqs = counts.tolist()
    opt.zero_grad(set_to_none=False)
    loss_value = kl_sum = 0.0
    if batch.mask.shape[0]:
        adv = group_advantages(batch.rewards, cfg.adv_std_norm).reshape(-1)
        logp = token_logps(model, batch.sequences, built.prompt_len, cfg.temperature)
        per_token = clipped_surrogate(logp, logp.detach(), adv, cfg.clip_eps_low, cfg.clip_eps_high)
        if ref is not None:
            with torch.no_grad():
                ref_logp = token_logps(ref, batch.sequences, built.prompt_len, cfg.temperature)
            kl = k3_kl(logp, ref_logp)
            per_token = per_token + cfg.kl_beta * kl
            kl_sum = float((kl.detach() * batch.mask).sum())
        loss = aggregate(per_token, batch.mask, cfg.loss_agg, total_tokens=total_tokens, total_seqs=total_seqs,
                         max_len=built.max_new)
        loss.backward()
        loss_value = float(loss.detach())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    sums = torch.tensor([float(batch.rewards.sum()), loss_value, kl_sum], dtype=torch.float64)
    for work in (manager.allreduce(flat, reduce_op=ReduceOp.SUM), manager.allreduce(sums, reduce_op=ReduceOp.SUM)):
        work.wait()
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    if not manager.should_commit():
        log.info("step %d not committed", step)
        return None
    opt.step()
    if rank != 0:
        return None
    reward_sum, loss_total, kl_total = sums.tolist()
    return {"step": step, "reward_mean": reward_sum / max(total_seqs, 1.0), "loss": loss_total,
            "kl": kl_total / max(total_tokens, 1.0), "world_size": world,
            "prompt_ids": list(range(frontier, frontier + cfg.prompts_per_step)), "redone": 0, "resumes": 0,
            "pid": os.getpid(), "step_s": time.perf_counter() - t0, "time": time.time()}


if __name__ == "__main__":
    main(sys.argv[1:])
