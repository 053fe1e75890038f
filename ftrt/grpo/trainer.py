"""The GRPO training loop: rollout, group advantages, clipped update, metrics, checkpoints.

Runs as one process or as N data-parallel ranks (``ftrt launch ... -m ftrt.grpo``; gloo on CPU)
and uses only ftrt's public embedding API: :func:`ftrt.init`, ``rt.checkpointer``,
``rt.heartbeat`` and ``rt.report_metrics``.

Exactness rules (what makes resume and elasticity lossless):

- step ``s`` trains the global prompts ``[frontier, frontier + prompts_per_step)``, where the
  frontier is saved in the checkpoint with the model and optimizer: it counts prompts whose
  update is committed, never what a loader has read ahead;
- ranks split a step's prompts in contiguous chunks (the first ``P mod world`` ranks take one
  more), so the global batch is the same at any world size; a step trained again in place after
  a peer was lost in its gradient all-reduce keeps each survivor's computed prompts with it
  (:mod:`ftrt.grpo.salvage`), and the same prompts make the same batch;
- samples are seeded by ``(seed, step, prompt_id, sample_idx)`` (see :mod:`ftrt.policy.sample`);
- loss normalisers are global (token and sequence counts all-reduced) and gradients are summed,
  so every world size computes the same update up to float summation order.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

import ftrt
from ftrt import _diag, progress
from ftrt.grpo.checkpointing import Cadences, SaveDecision, Saves, decide_save
from ftrt.grpo import runconfig
from ftrt.grpo.config import GRPOConfig
from ftrt.grpo.loss import group_advantages, policy_loss
from ftrt.grpo.salvage import Redo, Salvage, agree_on_redo, claim, rows_to_compute, shard
from ftrt.policy.model import param_count
from ftrt.policy.sample import Batch
from ftrt.grpo.sampling import FleetSampling, LocalSampling
from ftrt.policy.setting import build_setting
from ftrt.policy.tasks import Task, TokenizerVocab, Vocab
from ftrt.errors import FtrtError, WorldChanged
from ftrt.inplace import gather_names, sync_state_dict
from ftrt.runtime import Runtime

if TYPE_CHECKING:
    from ftrt.checkpoint.checkpointer import Checkpointer


class Metrics:
    """Rank 0's JSON-lines file: one line per trained step, the committed trajectory only.

    In place, a rank 0 that lost its round (it is leaving, or was frozen) may still write a line
    after the next round's rank 0 wrote its own: every change of the file happens under a lock
    (``<path>.lock``), and a line is written only if it is newer than the file's last one (a later
    step, or the same step trained again in a later round, which replaces it)."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def rewind(self, step: int) -> int:
        """Drop lines of steps >= ``step`` (trained but not committed); return how many."""
        if self.path is None or not self.path.exists():
            return 0
        with self._locked():
            return self._rewind(step)

    def _rewind(self, step: int) -> int:
        keep, dropped = [], 0
        for line in self.path.read_text().splitlines():  # type: ignore[union-attr]
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
        tmp = self.path.with_name(self.path.name + ".tmp")  # type: ignore[union-attr]
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, self.path)  # type: ignore[arg-type]
        return dropped

    def _last(self) -> dict[str, Any] | None:
        """The file's last line (read from its end), or None."""
        try:
            with open(self.path, "rb") as f:  # type: ignore[arg-type]
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 65536))
                tail = f.read().splitlines()
        except FileNotFoundError:
            return None
        for raw in reversed(tail):
            try:
                return json.loads(raw)
            except ValueError:
                continue  # torn, or cut by the seek
        return None

    def settle(self, step: int, last: dict[str, Any] | None) -> int:
        """Make the file end with step ``step - 1`` after the ranks agreed on ``step`` in place:
        drop the lines of steps >= ``step`` (a lost rank 0 recorded a step the others had not
        applied; it is trained again) and append ``last``, the record of step ``step - 1``, when the
        rank 0 that trained it was lost before it wrote it. Returns how many lines were dropped."""
        if self.path is None:
            return 0
        with self._locked():
            dropped = self._rewind(step) if self.path.exists() else 0
            if last and last.get("step") == step - 1:
                self._append(last)
        return dropped

    def append(self, record: dict) -> None:
        """Write ``record`` unless the file has its step already, from this round or a later one."""
        if self.path is None:
            return
        with self._locked():
            self._append(record)

    def _append(self, record: dict) -> None:
        prev = self._last()
        if prev is not None and prev.get("step", -1) >= record["step"]:
            if prev.get("round", 0) >= record.get("round", 0):
                return  # recorded already (by this round's rank 0, or a later one)
            self._rewind(record["step"])  # an older round's rank 0 recorded it: this one replaces it
        with open(self.path, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(record) + "\n")


class Progress:
    """The run's progress bar on a terminal (rank 0; ``tqdm``: a smoothed rate and the time left),
    silent elsewhere: ``progress=auto`` shows it only when stderr is a terminal."""

    def __init__(self, mode: progress.Mode, total: int, initial: int = 0) -> None:
        self.bar = progress.new_bar(total, "GRPO", "step", mode=mode, initial=initial)

    def update(self, step: int, reward: float, tps: float, world: int) -> None:
        """Step ``step`` (of the total) is done."""
        self.bar.set_postfix({"reward": f"{reward:.3f}", "tok/s": f"{tps:,.0f}", "world": world}, refresh=False)
        self.bar.update(max(0, step - self.bar.n))

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Run:
    """What one run of the trainer is built from, whatever its round (:func:`_setup`); ``state`` is
    what a checkpoint holds."""

    cfg: GRPOConfig
    rt: Runtime
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
    sampling: LocalSampling | FleetSampling
    """Where completions come from (``rollout.mode``)."""
    holds: bool = False
    """Whether ``state`` is one the job had after a whole step (restored, received or trained); False
    for a newcomer and while a step with several optimizer steps (``ppo_epochs``) is half applied."""
    started: bool = False
    """Whether this process entered a round before: its model may have moved from the initial weights."""
    last_line: dict[str, Any] | None = None
    """The metrics record of the last step this rank trained (every rank keeps it; rank 0 writes it)."""
    salvage: Salvage | None = None
    """The prompts of the step in flight whose gradient ``p.grad`` holds while the step's gradient
    all-reduce runs (kept when a lost peer fails it, for the step trained again: :mod:`ftrt.grpo.salvage`)."""

    @property
    def trainer(self) -> dict[str, int]:
        """The trainer's counters in ``state``: step, frontier, redone, resumes, tokens (a restore may
        replace this dict, so read it afresh rather than keep it across one)."""
        return self.state["trainer"]


@dataclass
class _Round:
    """What belongs to one round: this rank's place and what was built on the round's process group.
    A worker that changes rounds in place builds a new one (:func:`_enter_round`)."""

    rank: int
    world: int
    distributed: bool
    nodes: list[str]
    """The node of each rank."""
    ck: Checkpointer | None
    cadence: Cadences
    metrics: Metrics
    saves: Saves
    bar: Progress
    redo: Redo | None = None
    """The step this round trains again on gradients kept from its failed attempt, and each rank's
    prompts for it (:mod:`ftrt.grpo.salvage`); None: the usual shares."""


@dataclass
class _Step:
    """One trained step, as every rank agreed on it."""

    reward_mean: float
    loss: float
    kl: float
    """Summed over the step's tokens (divide by ``tokens`` for the mean)."""
    grad_norm: float
    """The global norm of the step's (last) summed gradient, before clipping."""
    tokens: float
    step_s: float
    parts: list[tuple[str, list[int]]]
    """Which node trained which prompts, in rank order."""
    round_ends: bool
    """The round ends after this step (a node joins or drains, and the workers restart at a round
    change; or the next round is inactive); never after the last step."""
    round_end_durable: bool
    """The round ends after this step with a storage save (the next round is inactive)."""
    leaves: bool
    """This rank's node is leaving the job and the others go on in place: this rank ends after the
    step."""
    sampling: dict[str, Any]
    """The step's own metrics-line fields: the sampling's (fleet: weight version, servers, timings)
    and, for a step trained again, what it reused of its failed attempt."""

    @property
    def prompt_ids(self) -> list[int]:
        return sorted(i for _, part in self.parts for i in part)


def train(cfg: GRPOConfig) -> dict[str, Any]:
    """Run (or resume) the configured GRPO job; return rank 0's summary (others: a partial one)."""
    if cfg.checkpoint.url:
        runconfig.check_before_start(cfg)
    run = _setup(cfg)
    t_start = time.perf_counter()
    rewards: list[float] = []
    try:
        rnd = _take_round(run, None)
        ended_for_round, rnd = _loop(run, rnd, rewards)
    finally:
        run.sampling.close()
    if not ended_for_round:
        run.rt.done()  # what follows (the summary, destroying the process group) is teardown, not a hang
    return _finish(run, rnd, rewards, time.perf_counter() - t_start, ended_for_round)


def _loop(run: _Run, rnd: _Round, rewards: list[float]) -> tuple[bool, _Round]:
    """Train from the agreed step to the end, or to the end of this round (return True then); in
    place, go on in each next round. Returns the round the run ended in."""
    cfg = run.cfg
    step_s = 0.0
    first = True
    resave_final = False  # a round changed after the last step's save started (it was given up)
    while (step := run.trainer["step"]) < cfg.steps:
        if _diag.holds_at("round_change", step):  # tests: a join surely lands mid-run
            _wait_for_round_change(run, step)
        try:
            # A join waits for this step's end (agreed on in its sums), but for the job's last step's: the
            # final save must be the new round's (a commit of the old one's is fenced off once it is written).
            with run.rt.step(agreed_joins=step + 1 < cfg.steps):
                done = _train_step(run, rnd, step, step_s)
                step_s = done.step_s
                rewards.append(done.reward_mean)
                decision = rnd.cadence.decide(step + 1, cfg.steps, round_ends=done.round_ends,
                                              durable=done.round_end_durable)
                _record(run, rnd, step, done, decision, first=first)
                first = False
                run.rt.heartbeat(step + 1)
                if decision.keep:
                    run.sampling.before_save(step + 1, run.state.get("rollout", {}), run.trainer["frontier"])
                rnd.saves.start(step + 1, decision)
                resave_final = False
        except WorldChanged as exc:
            rnd = _change_round(run, rnd, exc)
            resave_final = True
            continue
        if done.round_ends:
            rnd.saves.wait()  # the new round resumes from this save
            _diag.mark("round_end.saved", step=step + 1)
            return True, rnd
        if done.leaves:
            print(f"[ftrt.grpo] rank {rnd.rank}: this node leaves the job after step {step}; the other ranks go on "
                  "in place", flush=True)
            run.rt.exit_for_round()
    if resave_final and rnd.ck is not None:
        # the last step's save went with a round changed after it: save it again in this round
        final = decide_save(cfg.steps, cfg.steps, checkpointing=True, round_ends=False, storage_due=True,
                            memory_due=True)
        run.sampling.before_save(cfg.steps, run.state.get("rollout", {}), run.trainer["frontier"])
        rnd.saves.start(cfg.steps, final)
    rnd.bar.close()
    rnd.saves.close()  # waits for the last save: the final state is committed before we report
    return False, rnd


def _wait_for_round_change(run: _Run, step: int, timeout: float = 120.0) -> None:
    """Train no further than ``step`` until a new round comes or this round is asked to end (at
    most ``timeout`` s), heart-beating meanwhile (``FTRT_DIAG_HOLD=round_change:STEP``, tests)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (run.rt.world_changed() or run.rt.round_ending()):
        run.rt.heartbeat(step)
        time.sleep(0.05)


def _setup(cfg: GRPOConfig) -> _Run:
    """Build the task, the policy, its optimizer and the sampling (the same initial weights on
    every rank), then join the process group.

    Under ``ftrt launch`` the group is ftrt's (:meth:`ftrt.Runtime.init_process_group`, also at
    world size 1): with ``--recovery in-place`` this worker is then kept when the job's membership
    changes, and a worker of a joining node warms up to here before its node is admitted."""
    rt = ftrt.init()
    torch.set_num_threads(cfg.threads)
    built = build_setting(cfg.model, cfg.task, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens)
    task, vocab, model, max_new, prompt_len = built.task, built.vocab, built.model, built.max_new, built.prompt_len
    ref = copy.deepcopy(model).requires_grad_(False) if cfg.kl_beta > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.rollout.mode == "fleet":
        sampling: LocalSampling | FleetSampling = FleetSampling(cfg, task, vocab, model, max_new, job_id=rt.job_id)
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
    if rt.launched_by_ftrt and (rt.recovery == "in-place" or rt.world_size > 1):
        rt.init_process_group("gloo")  # a worker started before its node's admission waits here, warm
    elif rt.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    _diag.mark("process_group")
    return _Run(cfg=cfg, rt=rt, task=task, vocab=vocab, model=model, ref=ref, params=params, opt=opt, state=state,
                max_new=max_new, prompt_len=prompt_len, sampling=sampling)


def _take_round(run: _Run, old: _Round | None) -> _Round:
    """Enter this worker's round (``old``: leave that one first, in place), again for each next
    round while a peer is lost during the agreement."""
    leave, ck = old is not None, old.ck if old is not None else None
    while True:
        try:
            if leave:
                if ck is not None:
                    ck.retire()  # its save in flight is given up: the old round's groups are gone
                run.rt.reconfigure()  # a node that is leaving ends here
            with run.rt.step():  # a peer lost meanwhile: the next round
                return _enter_round(run)
        except WorldChanged as exc:
            print(f"[ftrt.grpo] rank {run.rt.rank}: {exc} (while the ranks agreed on the state)", flush=True)
            leave, ck = True, None  # _enter_round retired the checkpointer it built


def _change_round(run: _Run, rnd: _Round, why: WorldChanged) -> _Round:
    """Go on in the next round in place: the step in flight is trained again at the new world size."""
    rnd.bar.close()  # the next round's bar goes on from the step it resumes
    print(f"[ftrt.grpo] rank {rnd.rank}: {why}", flush=True)
    t0 = time.perf_counter()
    new = _take_round(run, rnd)
    if new.rank == 0:
        print(f"[ftrt.grpo] round {run.rt.round}: kept in place at step {run.trainer['step']} (world size "
              f"{new.world}) after {time.perf_counter() - t0:.2f} s", flush=True)
    return new


def _enter_round(run: _Run) -> _Round:
    """Build what belongs to this worker's round and agree on the state.

    Every rank runs this alike (its collectives and ``new_group`` calls in the same order), the ranks
    kept in place as the newcomers: this round's checkpointer (the old one's groups and round fence
    are gone), fresh cadences (every rank decides alike), rank 0's metrics file; then the state,
    and which rank holds which prompts' gradient of the step in flight (:mod:`ftrt.grpo.salvage`).
    Rank 0, when it holds a whole step's state, gives it to every rank (a rank one step ahead is
    rolled back: rank 0 wrote no record of that step, which is trained again), else the newest
    holder does; when no rank holds one (a job's start, or every rank half through a step) the
    state is restored from the newest checkpoint, as a restarted job would."""
    cfg, rt = run.cfg, run.rt
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    nodes = gather_names(rt.node_id, wait=rt.wait) if distributed else [rt.node_id]
    ck = rt.checkpointer(cfg.checkpoint.url, keep=cfg.checkpoint.keep,
                         storage_options=cfg.checkpoint.storage_options) if cfg.checkpoint.url else None
    _diag.mark("checkpointer")
    try:
        lost_ahead = run.sampling.regroup(rank, distributed, rt.wait)
        synced = -1
        if distributed:
            synced = _agree_on_state(run, -1 if lost_ahead else None)
        cadence = Cadences(rt, cfg, ck, announce=rank == 0, nodes=len(set(nodes)))
        metrics = Metrics(cfg.metrics_path if rank == 0 else None)
        if synced < 0:
            _restore(run, ck, cadence, metrics, rank, world)
        else:
            cadence.resumed(synced, None)
            if rank == 0:
                run.trainer["redone"] += metrics.settle(synced, run.last_line)
        run.holds = run.started = True
        redo = None
        if distributed:  # rank 0 counts what was trained again: every rank's counters say the same
            _share_counters(run)
            if cfg.steps_stand_alone:
                redo = _agree_on_redo(run, rank, world, synced)
        tr = run.trainer
        if tr["step"] < cfg.steps:
            run.sampling.start(tr["step"], run.state.get("rollout", {}), tr["frontier"])
    except BaseException:
        if ck is not None:
            ck.retire()
        raise
    _diag.mark("built")
    bar = Progress(cfg.progress if rank == 0 else "none", cfg.steps, initial=min(run.trainer["step"], cfg.steps))
    return _Round(rank=rank, world=world, distributed=distributed, nodes=nodes, ck=ck, cadence=cadence,
                  metrics=metrics, saves=Saves(ck, cadence, run.state), bar=bar, redo=redo)


def _agree_on_redo(run: _Run, rank: int, world: int, synced: int) -> Redo | None:
    """Agree on which rank holds a gradient of which prompts of the agreed step (kept from its failed
    attempt, at that step's weights) and on each rank's prompts for training the step again."""
    mine = claim(run.salvage, synced)
    if not mine:
        run.salvage = None  # of another step, or the state was restored: p.grad is not that any more
    redo = agree_on_redo(mine, synced, rank, world, run.cfg.prompts_per_step, run.rt.wait)
    if redo is not None and rank == 0:
        print(f"[ftrt.grpo] step {synced} is trained again on the gradients of {redo.kept} of its "
              f"{run.cfg.prompts_per_step} prompts kept from its failed attempt", flush=True)
    return redo


def _agree_on_state(run: _Run, applied: int | None) -> int:
    """Agree on the state over this round's group (:func:`ftrt.sync_state_dict`, rank 0 preferred);
    returns the agreed step, -1 when no rank holds a whole step's state. ``applied``: what this
    rank reports instead of its own step (-1: hold nothing).

    The state is taken into ``run.state`` itself, with the last step's record beside it, so weights
    and counters change together. A peer lost in one of the agreement's collectives leaves a
    whole state on every rank (a rank takes the sender's state locally, between two collectives);
    a rank that could not take it holds none until the next agreement."""
    if applied is None:
        applied = run.trainer["step"] if run.holds else -1
    run.state["line"] = run.last_line or {}
    try:
        synced = sync_state_dict(applied, run.state, wait=run.rt.wait, prefer=0)
    except WorldChanged:
        raise  # a peer lost in a collective: this rank's state is its own or, taken whole, the sender's
    except BaseException:
        run.holds = False
        raise
    finally:
        line = run.state.pop("line")
    run.last_line = line or None
    return synced


def _share_counters(run: _Run) -> None:
    """Give every rank rank 0's count of steps trained again and of resumes (only rank 0 counts
    them), so a later rank 0 goes on from the same numbers."""
    tr = run.trainer
    counters = torch.tensor([tr["redone"], tr["resumes"]], dtype=torch.int64)
    run.rt.wait(dist.broadcast(counters, 0, async_op=True))
    tr["redone"], tr["resumes"] = (int(x) for x in counters.tolist())


def _restore(run: _Run, ck: Checkpointer | None, cadence: Cadences, metrics: Metrics, rank: int, world: int) -> None:
    """Restore the newest checkpoint, if there is one, and drop the metrics lines of the steps it
    does not hold (rank 0: they will be trained again, and counted as redone)."""
    cfg = run.cfg
    run.salvage = None  # no gradient of the failed attempt survives a restore
    restored = ck.restore(run.state) if ck is not None else None
    if run.started and restored is None:  # this process's weights are not the initial ones any more
        raise FtrtError("The ranks lost the state of the step in flight (every rank was half through it, or the "
                        "rollout fleet's driver went with the samples ahead) and there is no checkpoint to go back "
                        "to; the workers restart. Set checkpoint.url to go back to a checkpoint in place.")
    _diag.mark("restored", tier=ck.last_restore_tier if restored is not None else None)
    tr = run.trainer  # after the restore, which may replace the counters' dict
    if restored is not None:
        tr["resumes"] += 1
        cadence.resumed(tr["step"], ck.last_restore_tier)
    if rank != 0:
        return
    if ck is not None:
        runconfig.record_once_started(cfg)
    dropped = metrics.rewind(tr["step"])
    if restored is not None:
        tr["redone"] += dropped
        print(f"[ftrt.grpo] resumed at step {tr['step']} of {cfg.steps} (world size {world}, from "
              f"{ck.last_restore_tier}); {dropped} uncommitted step(s) will be redone", flush=True)
        if tr["step"] >= cfg.steps:
            print(f"[ftrt.grpo] the run is already finished: its checkpoint at {cfg.checkpoint.url} is at step "
                  f"{tr['step']} of steps={cfg.steps}, so nothing is trained. Give a larger steps= to train on, or "
                  "another checkpoint.url for a new run.", flush=True)
        return
    if dropped:
        print(f"[ftrt.grpo] no checkpoint to resume from: starting at step 0 and clearing "
              f"{dropped} line(s) of an earlier run from {cfg.metrics_path}", flush=True)
    print(f"[ftrt.grpo] task {cfg.task.name} {cfg.task.params}, {param_count(run.model):,} parameters, "
          f"{cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
          f"world size {world}", flush=True)


def _all_reduce(run: _Run, rnd: _Round, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks (in place: a wait that a new round ends, :meth:`ftrt.Runtime.wait`)."""
    if rnd.distributed:
        run.rt.wait(dist.all_reduce(t, async_op=True))
    return t


def _train_step(run: _Run, rnd: _Round, step: int, last_step_s: float) -> _Step:
    """Train step ``step`` on this rank's share of its prompts and agree with the other ranks on
    its results; advance the trainer's counters. ``last_step_s``: the previous step's duration
    (for the checkpoint cadences).

    The step's last collective comes before its last optimizer step, and the counters follow that
    optimizer step at once: a rank whose collectives failed has not applied the step (or, with
    several ``ppo_epochs``, does not hold a whole step), and one that applied it counts it."""
    cfg, tr, rt = run.cfg, run.trainer, run.rt
    t0 = time.perf_counter()
    frontier = tr["frontier"]
    redo = rnd.redo.shares if rnd.redo is not None and rnd.redo.step == step else None
    shares = redo or [list(range(*shard(cfg.prompts_per_step, rnd.world, r))) for r in range(rnd.world)]
    offsets = shares[rnd.rank]
    kept = run.salvage if redo is not None and run.salvage is not None and run.salvage.step == step else None
    mine = [frontier + o for o in offsets]
    sampled = run.sampling.sample(step, mine, frontier)
    batch = sampled.batch
    counts = _all_reduce(run, rnd, torch.tensor([float(batch.mask.sum()), float(batch.mask.shape[0])],
                                                dtype=torch.float64))
    total_tokens, total_seqs = counts.tolist()
    loss_value, kl_sum = _update(run, rnd, batch, total_tokens, total_seqs, step, offsets, kept)
    # The cadence's inputs ride on this collective, so every rank decides on the same numbers.
    # A node is joining or draining: end this round after this step, saved in memory (the new
    # round redoes nothing), or to storage too when the next round is inactive (the job waits or
    # stops: the memory copies may leave with the nodes; the commit is allowed at a planned
    # change's boundary). Without a memory tier the agent stops us at once, as before. In place
    # only the last case ends the round: at a join or a drain the other ranks go on (the
    # draining node's ranks leave after the step).
    asked = rt.round_ending()
    ending_here = rnd.ck is not None and rnd.ck.has_memory_tier and asked
    durable_here = ending_here and rt.round_end_durable()
    leaves = rt.in_place and asked and not rt.round_end_durable()
    if rt.in_place and not durable_here:
        ending_here = False
    # A join (a round that only adds ranks) is taken after the step in which a rank saw it: every
    # rank reads the same sum, so all take it at the same step's start and nothing is trained again.
    sums = _all_reduce(run, rnd, torch.tensor([float(batch.rewards.sum()), loss_value, kl_sum, float(ending_here),
                                               float(durable_here), float(step + 1 < cfg.steps and rt.join_waiting()),
                                               *rnd.cadence.report(last_step_s)], dtype=torch.float64))
    reward_sum, loss_total, kl_total, ending, durable, joining, *agreed = sums.tolist()
    if joining > 0:
        rt.join_after_step()
    grad_norm = _apply(run, rnd)  # no collective from here to the counters
    tr.update(step=step + 1, frontier=frontier + cfg.prompts_per_step, tokens=tr["tokens"] + int(total_tokens))
    run.holds = True
    round_ends = ending > 0 and step + 1 < cfg.steps  # the last step ends the job anyway
    rnd.cadence.update(agreed, rnd.world, restores=tr["resumes"])
    parts = [(rnd.nodes[r], [frontier + o for o in share]) for r, share in enumerate(shares)]
    # A step trained again after a fault counts the samples and the gradients it reused from its
    # failed attempt as its own work (done before the fault; the rest of that attempt is lost).
    info = dict(sampled.info)
    if sampled.reused_s:
        info["reused_s"] = round(sampled.reused_s, 4)
    kept_s = kept.compute_s if kept is not None else 0.0
    if kept is not None:
        info.update(salvaged_prompts=len(kept.prompts), salvaged_s=round(kept_s, 4))
    step_s = time.perf_counter() - t0 + sampled.reused_s + kept_s
    return _Step(reward_mean=reward_sum / max(total_seqs, 1.0), loss=loss_total, kl=kl_total,
                 grad_norm=grad_norm, tokens=total_tokens, step_s=step_s, parts=parts,
                 round_ends=round_ends, round_end_durable=round_ends and durable > 0,
                 leaves=leaves and not round_ends, sampling=info)


def _update(run: _Run, rnd: _Round, batch: Batch, total_tokens: float, total_seqs: float, step: int,
            offsets: list[int], kept: Salvage | None) -> tuple[float, float]:
    """The clipped policy update on one rollout: ``ppo_epochs`` gradients, summed over the ranks,
    each applied before the next is computed; the last one is left for :func:`_apply`. Returns this
    rank's last loss and its summed KL.

    ``offsets`` are this rank's prompts (offsets in the step, the batch's order); ``kept``: the
    gradient ``p.grad`` already holds of some of them, from the step's failed attempt (only the
    others are computed, and added to it). While the gradient all-reduce runs, :attr:`_Run.salvage`
    says what ``p.grad`` holds, for the step's next attempt if a lost peer fails this one."""
    cfg, params = run.cfg, run.params
    if kept is not None:
        if not cfg.steps_stand_alone:
            raise FtrtError("A kept gradient needs one optimizer pass a step and local sampling (ppo_epochs=1, "
                            "rollout.mode=local); this is a bug in the trainer.")
        todo, rows = rows_to_compute(offsets, kept.prompts, cfg.group_size)
        sequences, mask = batch.sequences[rows], batch.mask[rows]
        adv = group_advantages(batch.rewards[todo], cfg.adv_std_norm).reshape(-1)
    else:
        sequences, mask = batch.sequences, batch.mask
        adv = group_advantages(batch.rewards, cfg.adv_std_norm).reshape(-1)
    old = ref_logp = None
    loss_value = kl_sum = 0.0
    for epoch in range(cfg.ppo_epochs):
        if epoch:
            _apply(run, rnd)
            _diag.crash_point("half_applied", run.trainer["step"])
        t_compute = time.perf_counter()
        run.salvage = None  # p.grad changes from here
        if kept is None:
            run.opt.zero_grad(set_to_none=False)
        if mask.shape[0]:
            pl = policy_loss(cfg, run.model, run.ref, sequences, mask, adv, prompt_len=run.prompt_len,
                             max_len=run.max_new, total_tokens=total_tokens, total_seqs=total_seqs, old_logp=old,
                             ref_logp=ref_logp)
            old, ref_logp = pl.old_logp, pl.ref_logp
            if run.ref is not None:
                kl_sum = pl.kl_sum
            pl.loss.backward()
            loss_value = float(pl.loss.detach())
        if kept is not None:
            loss_value, kl_sum = kept.loss + loss_value, kept.kl + kl_sum
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if rnd.distributed:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # p.grad stays this rank's own meanwhile
            if cfg.steps_stand_alone:
                spent = time.perf_counter() - t_compute + (kept.compute_s if kept is not None else 0.0)
                run.salvage = Salvage(step, tuple(offsets), loss_value, kl_sum, spent)
            _diag.crash_point("grad_reduce", step)
            if _diag.holds_at("grad_reduce", step):  # tests: a peer is lost while this step's gradients are out
                _diag.mark("held", point="grad_reduce", step=step)
                _wait_for_round_change(run, step)
            _all_reduce(run, rnd, flat)
            run.salvage = None  # p.grad is the sum from here
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
    return loss_value, kl_sum


def _apply(run: _Run, rnd: _Round) -> float:
    """One optimizer step on the summed gradients (clipped), once the save in flight copied the
    weights; returns their global norm before clipping."""
    if run.cfg.grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(run.params, run.cfg.grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in run.params])
    rnd.saves.before_update()  # the last checkpoint must have copied the weights first
    run.holds = False  # until the step's counters follow (several ppo_epochs: the step is half applied)
    run.opt.step()
    return float(norm)


def _record(run: _Run, rnd: _Round, step: int, done: _Step, decision: SaveDecision, *, first: bool) -> None:
    """Publish a trained step: rank 0's metrics line and Prometheus gauges, the progress bar. Every
    rank keeps the line (a new rank 0 writes it if the one that trained the step was lost first)."""
    tr = run.trainer
    record = {
        "step": step, "reward_mean": done.reward_mean, "loss": done.loss,
        "kl": done.kl / max(done.tokens, 1.0), "grad_norm": done.grad_norm, "world_size": rnd.world,
        "prompt_ids": done.prompt_ids,
        "tokens_per_s": done.tokens / done.step_s, "time": time.time(), "step_s": done.step_s,
        "redone": tr["redone"], "resumes": tr["resumes"], "nodes": sorted({n for n, _ in done.parts}),
        "round": run.rt.round, "pid": os.getpid(),
        "ckpt": decision.tier,  # the save due after this step
        **done.sampling,
    }
    if "rollout_s" in done.sampling:  # the wait for completions (with the push) against the rest
        record["train_s"] = max(0.0, done.step_s - done.sampling["rollout_s"])
    run.last_line = record
    rnd.metrics.append(record)
    if first:
        _diag.mark("first_step", step=step, step_s=done.step_s)
    rnd.bar.update(step + 1, done.reward_mean, done.tokens / done.step_s, rnd.world)
    if rnd.rank == 0:  # Prometheus, through the node's agent (ftrt launch --metrics-port)
        run.rt.report_metrics(reward_mean=done.reward_mean, kl=record["kl"], loss=done.loss,
                              tokens_per_second=done.tokens / done.step_s)


def _finish(run: _Run, rnd: _Round, rewards: list[float], wall: float, ended_for_round: bool) -> dict[str, Any]:
    """Say how the run ended, leave the round or the process group, and return the summary."""
    tr = run.trainer
    last = rewards[-10:]
    summary = {
        "steps": tr["step"], "final_reward": sum(last) / len(last) if last else None,
        "world_size": rnd.world, "tokens": tr["tokens"], "wall_s": wall, "redone": tr["redone"],
        "resumes": tr["resumes"], "ended_for_round": ended_for_round,
    }
    if rnd.rank == 0 and ended_for_round:
        print(f"[ftrt.grpo] round {run.rt.round} ends after step {tr['step'] - 1}: saved; the next round resumes "
              f"at step {tr['step']}", flush=True)
    elif rnd.rank == 0 and rewards:
        print(f"[ftrt.grpo] done: {tr['step']} steps, mean reward of the last {len(last)} steps "
              f"{summary['final_reward']:.3f}, {wall:.1f} s this run, {tr['redone']} step(s) redone", flush=True)
    if ended_for_round:
        run.rt.exit_for_round()  # saved: the next round waits for this process to be gone
    if rnd.distributed:
        dist.destroy_process_group()
    return summary
