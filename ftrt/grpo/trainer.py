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
- samples are seeded by ``(seed, step, prompt_id, sample_idx)`` (see :mod:`ftrt.policy.sample`);
- loss normalisers are global (token and sequence counts all-reduced) and gradients are summed,
  so every world size computes the same update up to float summation order.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import ftrt
from ftrt import _diag
from ftrt.grpo.checkpointing import Cadences, SaveDecision, Saves
from ftrt.grpo.config import GRPOConfig
from ftrt.grpo.loss import aggregate, clipped_surrogate, group_advantages, k3_kl
from ftrt.policy.model import param_count
from ftrt.policy.sample import Batch, token_logps
from ftrt.grpo.sampling import FleetSampling, LocalSampling
from ftrt.policy.setting import build_setting
from ftrt.policy.tasks import Task, TokenizerVocab, Vocab
from ftrt.runtime import Runtime

if TYPE_CHECKING:
    from ftrt.checkpoint.checkpointer import Checkpointer


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


@dataclass
class _Run:
    """What one run of the trainer is built from (:func:`_setup`); ``state`` is what a checkpoint holds."""

    cfg: GRPOConfig
    rt: Runtime
    distributed: bool
    rank: int
    world: int
    task: Task
    vocab: Vocab | TokenizerVocab
    model: torch.nn.Module
    ref: torch.nn.Module | None
    """The frozen initial policy the KL is measured against (None without ``kl_beta``)."""
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    state: dict[str, Any]
    max_new: int
    prompt_len: int
    ck: Checkpointer | None
    cadence: Cadences
    metrics: Metrics
    sampling: LocalSampling | FleetSampling
    """Where completions come from (``rollout.mode``)."""

    @property
    def trainer(self) -> dict[str, int]:
        """The trainer's counters in ``state``: step, frontier, redone, resumes, tokens (a restore may
        replace this dict, so read it afresh rather than keep it across one)."""
        return self.state["trainer"]


@dataclass
class _Step:
    """One trained step, as every rank agreed on it."""

    reward_mean: float
    loss: float
    kl: float
    """Summed over the step's tokens (divide by ``tokens`` for the mean)."""
    tokens: float
    step_s: float
    parts: list[tuple[str, list[int]]]
    """Which node trained which prompts, in rank order."""
    round_ends: bool
    """A node is joining: the round ends after this step (never after the last one)."""
    round_end_durable: bool
    """The round ends after this step with a storage save (the next round is inactive)."""
    sampling: dict[str, Any]
    """The sampling's metrics-line fields (fleet: weight version, servers, timings)."""

    @property
    def prompt_ids(self) -> list[int]:
        return [i for _, part in self.parts for i in part]


def train(cfg: GRPOConfig) -> dict[str, Any]:
    """Run (or resume) the configured GRPO job; return rank 0's summary (others: a partial one)."""
    run = _setup(cfg)
    t_start = time.perf_counter()
    rewards: list[float] = []
    try:
        _resume(run)
        ended_for_round = _loop(run, rewards)
    finally:
        run.sampling.close()
    if not ended_for_round:
        run.rt.done()  # what follows (the summary, destroying the process group) is teardown, not a hang
    return _finish(run, rewards, time.perf_counter() - t_start, ended_for_round)


def _loop(run: _Run, rewards: list[float]) -> bool:
    """Train from the restored step to the end, or to the end of this round (return True then)."""
    cfg, tr = run.cfg, run.trainer
    bar = Progress(cfg.progress if run.rank == 0 else "none", cfg.steps)
    saves = Saves(run.ck, run.cadence, run.state)
    step_s = 0.0
    first_step = tr["step"]
    ended_for_round = False
    if tr["step"] < cfg.steps:
        run.sampling.start(tr["step"], run.state.get("rollout", {}), tr["frontier"])
    for step in range(tr["step"], cfg.steps):
        done = _train_step(run, step, saves, step_s)
        step_s = done.step_s
        rewards.append(done.reward_mean)
        decision = run.cadence.decide(step + 1, cfg.steps, round_ends=done.round_ends,
                                      durable=done.round_end_durable)
        _record(run, step, done, decision, bar, first=step == first_step)
        run.rt.heartbeat(step + 1)
        if decision.keep:
            run.sampling.before_save(step + 1, run.state.get("rollout", {}), run.trainer["frontier"])
        saves.start(step + 1, decision)
        if done.round_ends:
            saves.wait()  # the new round resumes from this save
            _diag.mark("round_end.saved", step=step + 1)
            ended_for_round = True
            break
    bar.close()
    saves.close()  # waits for the last save: the final state is committed before we report
    return ended_for_round


def _setup(cfg: GRPOConfig) -> _Run:
    """Join the process group and build the task, the policy, its optimizer, the checkpointer,
    the checkpoint cadences and the metrics file (the same initial weights on every rank)."""
    rt = ftrt.init()
    torch.set_num_threads(cfg.threads)
    distributed = rt.world_size > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo")
    _diag.mark("process_group")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    built = build_setting(cfg.model, cfg.task, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens)
    task, vocab, model, max_new, prompt_len = built.task, built.vocab, built.model, built.max_new, built.prompt_len
    ref = copy.deepcopy(model).requires_grad_(False) if cfg.kl_beta > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.rollout.mode == "fleet":
        sampling: LocalSampling | FleetSampling = FleetSampling(cfg, task, vocab, model, max_new, rank=rank,
                                                                distributed=distributed, job_id=rt.job_id)
    else:
        sampling = LocalSampling(cfg, task, vocab, model, max_new)
    state: dict[str, Any] = {
        "model": model, "optim": opt,
        "trainer": {"step": 0, "frontier": 0, "redone": 0, "resumes": 0, "tokens": 0},
    }
    ahead = sampling.state()
    if ahead:  # the fleet's samples ahead (max_off_policy_steps > 0)
        state["rollout"] = ahead
    _diag.mark("model")
    ck = rt.checkpointer(cfg.checkpoint.url, keep=cfg.checkpoint.keep,
                         storage_options=cfg.checkpoint.storage_options) if cfg.checkpoint.url else None
    _diag.mark("checkpointer")
    cadence = Cadences(rt, cfg, ck, announce=rank == 0)
    metrics = Metrics(cfg.metrics_path if rank == 0 else None)
    _diag.mark("built")
    return _Run(cfg=cfg, rt=rt, distributed=distributed, rank=rank, world=world, task=task, vocab=vocab,
                model=model, ref=ref, params=params, opt=opt, state=state, max_new=max_new, prompt_len=prompt_len,
                ck=ck, cadence=cadence, metrics=metrics, sampling=sampling)


def _resume(run: _Run) -> None:
    """Restore the newest checkpoint, if there is one, and drop the metrics lines of the steps it
    does not hold (rank 0: they will be trained again, and counted as redone)."""
    cfg, ck = run.cfg, run.ck
    restored = ck.restore(run.state) if ck is not None else None
    _diag.mark("restored", tier=ck.last_restore_tier if restored is not None else None)
    tr = run.trainer  # after the restore, which may replace the counters' dict
    if restored is not None:
        tr["resumes"] += 1
        run.cadence.resumed(tr["step"], ck.last_restore_tier)
    if run.rank != 0:
        return
    dropped = run.metrics.rewind(tr["step"])
    if restored is not None:
        tr["redone"] += dropped
        print(f"[ftrt.grpo] resumed at step {tr['step']} of {cfg.steps} (world size {run.world}, from "
              f"{ck.last_restore_tier}); {dropped} uncommitted step(s) will be redone", flush=True)
        return
    if dropped:
        print(f"[ftrt.grpo] no checkpoint to resume from: starting at step 0 and clearing "
              f"{dropped} line(s) of an earlier run from {cfg.metrics_path}", flush=True)
    print(f"[ftrt.grpo] task {cfg.task.name} {cfg.task.params}, {param_count(run.model):,} parameters, "
          f"{cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
          f"world size {run.world}", flush=True)


def _train_step(run: _Run, step: int, saves: Saves, last_step_s: float) -> _Step:
    """Train step ``step`` on this rank's share of its prompts and agree with the other ranks on
    its results; advance the trainer's counters. ``last_step_s``: the previous step's duration
    (for the checkpoint cadences)."""
    cfg, tr = run.cfg, run.trainer
    t0 = time.perf_counter()
    frontier = tr["frontier"]
    lo, hi = shard(cfg.prompts_per_step, run.world, run.rank)
    mine = list(range(frontier + lo, frontier + hi))
    sampled = run.sampling.sample(step, mine, frontier)
    batch = sampled.batch
    counts = _all_reduce(torch.tensor([float(batch.mask.sum()), float(batch.mask.shape[0])],
                                      dtype=torch.float64), run.distributed)
    total_tokens, total_seqs = counts.tolist()
    loss_value, kl_sum = _update(run, batch, total_tokens, total_seqs, saves)
    # The cadence's inputs ride on this collective, so every rank decides on the same numbers.
    # A node is joining or draining: end this round after this step, saved in memory (the new
    # round redoes nothing), or to storage too when the next round is inactive (the job waits or
    # stops: the memory copies may leave with the nodes; the commit is allowed at a planned
    # change's boundary). Without a memory tier the agent stops us at once, as before.
    ending_here = run.ck is not None and run.ck.has_memory_tier and run.rt.round_ending()
    durable_here = ending_here and run.rt.round_end_durable()  # no memory copy would outlive the nodes
    sums = _all_reduce(torch.tensor([float(batch.rewards.sum()), loss_value, kl_sum, float(ending_here),
                                     float(durable_here), *run.cadence.report(last_step_s)], dtype=torch.float64),
                       run.distributed)
    reward_sum, loss_total, kl_total, ending, durable, *agreed = sums.tolist()
    round_ends = ending > 0 and step + 1 < cfg.steps  # the last step ends the job anyway
    run.cadence.update(agreed, run.world)
    parts = _gather((run.rt.node_id, mine), run.distributed, run.world)  # which node trained which prompts
    tr.update(step=step + 1, frontier=frontier + cfg.prompts_per_step, tokens=tr["tokens"] + int(total_tokens))
    return _Step(reward_mean=reward_sum / max(total_seqs, 1.0), loss=loss_total, kl=kl_total,
                 tokens=total_tokens, step_s=time.perf_counter() - t0, parts=parts, round_ends=round_ends,
                 round_end_durable=round_ends and durable > 0,
                 sampling=sampled.info)


def _update(run: _Run, batch: Batch, total_tokens: float, total_seqs: float, saves: Saves) -> tuple[float, float]:
    """The clipped policy update on one rollout (``ppo_epochs`` optimizer steps, gradients summed
    over the ranks); return this rank's last loss and its summed KL."""
    cfg, params, opt = run.cfg, run.params, run.opt
    adv = group_advantages(batch.rewards, cfg.adv_std_norm).reshape(-1)
    old = ref_logp = None
    loss_value = kl_sum = 0.0
    for _ in range(cfg.ppo_epochs):
        opt.zero_grad(set_to_none=False)
        if batch.mask.shape[0]:
            logp = token_logps(run.model, batch.sequences, run.prompt_len, cfg.temperature)
            old = logp.detach() if old is None else old
            per_token = clipped_surrogate(logp, old, adv, cfg.clip_eps_low, cfg.clip_eps_high)
            if run.ref is not None:
                if ref_logp is None:
                    with torch.no_grad():
                        ref_logp = token_logps(run.ref, batch.sequences, run.prompt_len, cfg.temperature)
                kl = k3_kl(logp, ref_logp)
                per_token = per_token + cfg.kl_beta * kl
                kl_sum = float((kl.detach() * batch.mask).sum())
            loss = aggregate(per_token, batch.mask, cfg.loss_agg, total_tokens=total_tokens,
                             total_seqs=total_seqs, max_len=run.max_new)
            loss.backward()
            loss_value = float(loss.detach())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if run.distributed:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        saves.before_update()  # the last checkpoint must have copied the weights first
        opt.step()
    return loss_value, kl_sum


def _record(run: _Run, step: int, done: _Step, decision: SaveDecision, bar: Progress, *, first: bool) -> None:
    """Publish a trained step: rank 0's metrics line and Prometheus gauges, the progress bar."""
    tr = run.trainer
    record = {
        "step": step, "reward_mean": done.reward_mean, "loss": done.loss,
        "kl": done.kl / max(done.tokens, 1.0), "world_size": run.world, "prompt_ids": done.prompt_ids,
        "tokens_per_s": done.tokens / done.step_s, "time": time.time(), "step_s": done.step_s,
        "redone": tr["redone"], "resumes": tr["resumes"], "nodes": sorted({n for n, _ in done.parts}),
        "ckpt": decision.tier,  # the save due after this step
        **done.sampling,
    }
    if "rollout_s" in done.sampling:  # the wait for completions (with the push) against the rest
        record["train_s"] = max(0.0, done.step_s - done.sampling["rollout_s"])
    run.metrics.append(record)
    if first:
        _diag.mark("first_step", step=step, step_s=done.step_s)
    bar.update(step + 1, done.reward_mean, done.tokens / done.step_s, run.world)
    if run.rank == 0:  # Prometheus, through the node's agent (ftrt launch --metrics-port)
        run.rt.report_metrics(reward_mean=done.reward_mean, kl=record["kl"], loss=done.loss,
                              tokens_per_second=done.tokens / done.step_s)


def _finish(run: _Run, rewards: list[float], wall: float, ended_for_round: bool) -> dict[str, Any]:
    """Say how the run ended, leave the round or the process group, and return the summary."""
    tr = run.trainer
    last = rewards[-10:]
    summary = {
        "steps": tr["step"], "final_reward": sum(last) / len(last) if last else None,
        "world_size": run.world, "tokens": tr["tokens"], "wall_s": wall, "redone": tr["redone"],
        "resumes": tr["resumes"], "ended_for_round": ended_for_round,
    }
    if run.rank == 0 and ended_for_round:
        print(f"[ftrt.grpo] round {run.rt.round} ends after step {tr['step'] - 1}: saved; the next round resumes "
              f"at step {tr['step']}", flush=True)
    elif run.rank == 0 and rewards:
        print(f"[ftrt.grpo] done: {tr['step']} steps, mean reward of the last {len(last)} steps "
              f"{summary['final_reward']:.3f}, {wall:.1f} s this run, {tr['redone']} step(s) redone", flush=True)
    if ended_for_round:
        run.rt.exit_for_round()  # saved: the next round waits for this process to be gone
    if run.distributed:
        dist.destroy_process_group()
    return summary


def _gather(mine: Any, distributed: bool, world: int) -> list[Any]:
    if not distributed:
        return [mine]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return parts
