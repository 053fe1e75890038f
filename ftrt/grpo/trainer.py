"""The GRPO training loop: rollout, group advantages, clipped update, metrics, checkpoints.

Runs as one process or as N data-parallel ranks (``ftrt launch ... -m ftrt.grpo``; gloo on CPU)
and uses only ftrt's public embedding API: :func:`ftrt.init`, ``rt.checkpointer``,
``rt.heartbeat`` and ``rt.report_metrics``.

Exactness rules (what makes resume and elasticity lossless):

- step ``s`` trains the global prompts ``[frontier, frontier + prompts_per_step)``, where the
  frontier is saved in the checkpoint with the model and optimizer: it counts prompts whose
  update is committed, never what a loader has read ahead;
- ranks split a step's prompts in contiguous chunks (the first ``P mod world`` ranks take one
  more), so the global batch is the same at any world size;
- samples are seeded by ``(seed, step, prompt_id, sample_idx)`` (see :mod:`ftrt.grpo.rollout`);
- loss normalisers are global (token and sequence counts all-reduced) and gradients are summed,
  so every world size computes the same update up to float summation order.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ftrt
from ftrt import _diag
from ftrt.grpo.checkpointing import Cadences
from ftrt.grpo.config import GRPOConfig
from ftrt.grpo.loss import aggregate, clipped_surrogate, group_advantages, k3_kl
from ftrt.grpo.model import build_policy, param_count
from ftrt.grpo.rollout import rollout, token_logps
from ftrt.grpo.tasks import TokenizerVocab, Vocab, make_task


def shard(n: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous slice ``[lo, hi)`` of ``n`` items (the first ``n % world`` get one more)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class Metrics:
    """Rank 0's JSON-lines file: one line per trained step, the committed trajectory only."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None

    def rewind(self, step: int) -> int:
        """Drop lines of steps >= ``step`` (trained but not committed); return how many."""
        if self.path is None or not self.path.exists():
            return 0
        keep, dropped = [], 0
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                s = json.loads(line).get("step", -1)
            except ValueError:
                dropped += 1  # a line torn by a kill mid-write
                continue
            if s >= step:
                dropped += 1
            else:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, self.path)
        return dropped

    def append(self, record: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class Progress:
    """A one-line progress bar on a terminal (rank 0), silent elsewhere."""

    def __init__(self, mode: str, total: int) -> None:
        self.on = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.total = total

    def update(self, step: int, reward: float, tps: float, world: int) -> None:
        if not self.on:
            return
        width = 30
        done = int(width * step / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{self.total} "
                         f"reward {reward:.3f} {tps:,.0f} tok/s world {world} ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


def _all_reduce(t: torch.Tensor, distributed: bool) -> torch.Tensor:
    if distributed:
        dist.all_reduce(t)
    return t


def train(cfg: GRPOConfig) -> dict[str, Any]:
    """Run (or resume) the configured GRPO job; return rank 0's summary (others: a partial one)."""
    rt = ftrt.init()
    torch.set_num_threads(cfg.threads)
    distributed = rt.world_size > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo")
    _diag.mark("process_group")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    task = make_task(cfg.task.name, cfg.task.params)
    max_new = cfg.max_new_tokens or task.answer_len
    prompt_len = task.prompt_len + 2
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if cfg.model.hf_path:
        model = build_policy(cfg.model, 0, prompt_len + max_new)
        vocab: Vocab | TokenizerVocab = TokenizerVocab(task, model.tokenizer)
    else:
        vocab = Vocab(task)
        model = build_policy(cfg.model, len(vocab), prompt_len + max_new)
    ref = copy.deepcopy(model).requires_grad_(False) if cfg.kl_beta > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    state: dict[str, Any] = {
        "model": model, "optim": opt,
        "trainer": {"step": 0, "frontier": 0, "redone": 0, "resumes": 0, "tokens": 0},
    }
    _diag.mark("model")
    ck = rt.checkpointer(cfg.checkpoint.url, keep=cfg.checkpoint.keep,
                         storage_options=cfg.checkpoint.storage_options) if cfg.checkpoint.url else None
    _diag.mark("checkpointer")
    cadence = Cadences(rt, cfg, ck, announce=rank == 0)
    metrics = Metrics(cfg.metrics_path if rank == 0 else None)
    _diag.mark("built")
    restored = ck.restore(state) if ck is not None else None
    _diag.mark("restored", tier=ck.last_restore_tier if restored is not None else None)
    tr = state["trainer"]
    if restored is not None:
        tr["resumes"] += 1
        cadence.resumed(tr["step"])
    if rank == 0:
        dropped = metrics.rewind(tr["step"])
        if restored is not None:
            tr["redone"] += dropped
            print(f"[ftrt.grpo] resumed at step {tr['step']} of {cfg.steps} (world size {world}, from "
                  f"{ck.last_restore_tier}); {dropped} uncommitted step(s) will be redone", flush=True)
        else:
            if dropped:
                print(f"[ftrt.grpo] no checkpoint to resume from: starting at step 0 and clearing "
                      f"{dropped} line(s) of an earlier run from {cfg.metrics_path}", flush=True)
            print(f"[ftrt.grpo] task {cfg.task.name} {cfg.task.params}, {param_count(model):,} parameters, "
                  f"{cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
                  f"world size {world}", flush=True)
    bar = Progress(cfg.progress if rank == 0 else "none", cfg.steps)
    pending = None
    dt = 0.0
    rewards: list[float] = []
    t_start = time.perf_counter()
    first_step = tr["step"]
    ended_for_round = False
    for step in range(tr["step"], cfg.steps):
        t0 = time.perf_counter()
        frontier = tr["frontier"]
        lo, hi = shard(cfg.prompts_per_step, world, rank)
        mine = list(range(frontier + lo, frontier + hi))
        batch = rollout(model, task, vocab, seed=cfg.seed, step=step, prompt_ids=mine,
                        group=cfg.group_size, max_new=max_new, temperature=cfg.temperature)
        adv = group_advantages(batch.rewards, cfg.adv_std_norm).reshape(-1)
        counts = _all_reduce(torch.tensor([float(batch.mask.sum()), float(batch.mask.shape[0])],
                                          dtype=torch.float64), distributed)
        total_tokens, total_seqs = counts.tolist()
        old = ref_logp = None
        loss_value = kl_sum = 0.0
        for _ in range(cfg.ppo_epochs):
            opt.zero_grad(set_to_none=False)
            if batch.mask.shape[0]:
                logp = token_logps(model, batch.sequences, prompt_len, cfg.temperature)
                old = logp.detach() if old is None else old
                per_token = clipped_surrogate(logp, old, adv, cfg.clip_eps_low, cfg.clip_eps_high)
                if ref is not None:
                    if ref_logp is None:
                        with torch.no_grad():
                            ref_logp = token_logps(ref, batch.sequences, prompt_len, cfg.temperature)
                    kl = k3_kl(logp, ref_logp)
                    per_token = per_token + cfg.kl_beta * kl
                    kl_sum = float((kl.detach() * batch.mask).sum())
                loss = aggregate(per_token, batch.mask, cfg.loss_agg, total_tokens=total_tokens,
                                 total_seqs=total_seqs, max_len=max_new)
                loss.backward()
                loss_value = float(loss.detach())
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if distributed:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat)
                off = 0
                for p in params:
                    p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            if pending is not None:  # the last checkpoint must have copied the weights first
                pending.wait_staged()
                pending = None
            opt.step()
        # The cadence's inputs ride on this collective, so every rank decides on the same numbers.
        # A node is joining: end this round after this step, saved in memory (the new round
        # redoes nothing). Storage cannot take that save (its commit is fenced by the round that
        # is ending), so without a memory tier the agent stops us at once, as before.
        ending_here = ck is not None and ck.has_memory_tier and rt.round_ending()
        sums = _all_reduce(torch.tensor([float(batch.rewards.sum()), loss_value, kl_sum, float(ending_here),
                                         *cadence.report(dt)], dtype=torch.float64), distributed)
        reward_sum, loss_total, kl_total, ending, *agreed = sums.tolist()
        round_ends = ending > 0 and step + 1 < cfg.steps  # the last step ends the job anyway
        cadence.update(agreed, world)
        parts = _gather((rt.node_id, mine), distributed, world)  # which node trained which prompts
        ids = [i for _, part in parts for i in part]
        tr.update(step=step + 1, frontier=frontier + cfg.prompts_per_step, tokens=tr["tokens"] + int(total_tokens))
        dt = time.perf_counter() - t0
        reward_mean = reward_sum / max(total_seqs, 1.0)
        rewards.append(reward_mean)
        persist = ck is not None and not round_ends and (cadence.storage.due(step + 1) or step + 1 == cfg.steps)
        keep = persist or round_ends or (ck is not None and cadence.memory.due(step + 1))
        record = {
            "step": step, "reward_mean": reward_mean, "loss": loss_total,
            "kl": kl_total / max(total_tokens, 1.0), "world_size": world, "prompt_ids": ids,
            "tokens_per_s": total_tokens / dt, "time": time.time(), "step_s": dt,
            "redone": tr["redone"], "resumes": tr["resumes"], "nodes": sorted({n for n, _ in parts}),
            "ckpt": "storage" if persist else "memory" if keep else None,  # the save due after this step
        }
        metrics.append(record)
        if step == first_step:
            _diag.mark("first_step", step=step, step_s=dt)
        bar.update(step + 1, reward_mean, total_tokens / dt, world)
        if rank == 0:  # Prometheus, through the node's agent (ftrt launch --metrics-port)
            rt.report_metrics(reward_mean=reward_mean, kl=record["kl"], loss=loss_total,
                              tokens_per_second=total_tokens / dt)
        rt.heartbeat(step + 1)
        if keep:
            # Slow storage must not slow training: a save that would queue behind an unfinished
            # one is skipped (memory copy only); the final one, and the one a round ends with,
            # never are.
            pending = ck.save(step + 1, state, persist=persist,
                              skip_if_busy=step + 1 < cfg.steps and not round_ends)
            cadence.started(pending)
        if round_ends:
            pending.wait()  # the new round resumes from this save
            _diag.mark("round_end.saved", step=step + 1)
            ended_for_round = True
            break
    bar.close()
    if ck is not None:
        ck.close()  # waits for the last save: the final state is committed before we report
    if not ended_for_round:
        rt.done()  # what follows (the summary, destroying the process group) is teardown, not a hang
    wall = time.perf_counter() - t_start
    last = rewards[-10:]
    summary = {
        "steps": tr["step"], "final_reward": sum(last) / len(last) if last else None,
        "world_size": world, "tokens": tr["tokens"], "wall_s": wall, "redone": tr["redone"],
        "resumes": tr["resumes"], "ended_for_round": ended_for_round,
    }
    if rank == 0 and ended_for_round:
        print(f"[ftrt.grpo] round {rt.round} ends after step {tr['step'] - 1}: saved; the next round resumes "
              f"at step {tr['step']}", flush=True)
    elif rank == 0 and rewards:
        print(f"[ftrt.grpo] done: {tr['step']} steps, mean reward of the last {len(last)} steps "
              f"{summary['final_reward']:.3f}, {wall:.1f} s this run, {tr['redone']} step(s) redone", flush=True)
    if ended_for_round:
        rt.exit_for_round()  # saved: the next round waits for this process to be gone
    if distributed:
        dist.destroy_process_group()
    return summary


def _gather(mine: Any, distributed: bool, world: int) -> list[Any]:
    if not distributed:
        return [mine]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return parts
