"""Where a step's completions come from: each rank's own sampling, or the rollout fleet.

:class:`LocalSampling` (``rollout.mode=local``) samples a rank's prompts in the rank.
:class:`FleetSampling` (``rollout.mode=fleet``): rank 0 publishes each new weight version to the
job's rollout servers, submits prompt groups with the version they must be sampled with, and
broadcasts the step's completions to every rank, which scores its own share. With
``max_off_policy_steps = K``, step s is sampled with exactly the weights of version
max(0, s - K), submitted K steps ahead. The completions of steps sampled ahead of the trained
step are part of every checkpoint (``state["rollout"]``), since the weights they were made with
are not: a resumed run trains exactly what the uninterrupted one trains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import ftrt
from ftrt.errors import ConfigError
from ftrt.grpo.config import GRPOConfig
from ftrt.policy.sample import Batch, complete, make_prompts, score, uniforms
from ftrt.policy.tasks import Task, TokenizerVocab, Vocab


@dataclass(frozen=True)
class Sampled:
    """A rank's share of a step and what getting it cost."""

    batch: Batch
    info: dict[str, Any]
    """Metrics-line fields (fleet: weight_version, rollout_servers, redispatched, push_s, rollout_s)."""
    reused_s: float = 0.0
    """Seconds the completions reused from this step's earlier attempt took to sample."""


def output_size(model: torch.nn.Module, fallback: int) -> int:
    """How many token ids the policy can sample (its output layer's width; a Hugging Face model's
    may exceed its tokenizer's vocabulary)."""
    lm = getattr(model, "lm", None)
    size = getattr(getattr(lm, "config", None), "vocab_size", None) if lm is not None else None
    head = getattr(model, "head", None)
    return int(size or (head.out_features if head is not None else fallback))


class LocalSampling:
    """Each rank samples its own prompts with the current weights.

    It keeps the completions of the last step it sampled: a step trained again in place (a peer was
    lost in the step's collectives, after this rank had sampled its share, and no rank applied
    the step) has the same weights and seeds, so this rank samples only the prompts it did not
    have (the lost rank's share, split anew) and reuses the rest. The time the reused samples took
    is reported (:attr:`Sampled.reused_s`): it is the step's work, done before the fault."""

    def __init__(self, cfg: GRPOConfig, task: Task, vocab: Vocab | TokenizerVocab, model: torch.nn.Module,
                 max_new: int) -> None:
        self.cfg, self.task, self.vocab, self.model, self.max_new = cfg, task, vocab, model, max_new
        self._made: tuple[int, dict[int, tuple[torch.Tensor, float]]] = (-1, {})
        """(step, {prompt id: (its group's completions, the seconds sampling it took)})."""

    def regroup(self, rank: int, distributed: bool, wait: Callable[[Any], None]) -> bool:
        return False  # nothing held across steps

    def state(self) -> dict[str, Any]:
        return {}

    def start(self, step: int, state: dict[str, Any], frontier: int) -> None:
        pass

    def sample(self, step: int, prompt_ids: list[int], frontier: int) -> Sampled:
        cfg, g = self.cfg, self.cfg.group_size
        have = self._made[1] if self._made[0] == step else {}
        need = [pid for pid in prompt_ids if pid not in have]
        made = dict(have)
        if need:
            t0 = time.perf_counter()
            prompts, _ = make_prompts(self.task, self.vocab, cfg.seed, need)
            u = uniforms(cfg.seed, step, need, g, self.max_new)
            out = complete(self.model, self.vocab, prompts, u, group=g, max_new=self.max_new,
                           temperature=cfg.temperature)
            each = (time.perf_counter() - t0) / len(need)
            made.update({pid: (out[i * g:(i + 1) * g], each) for i, pid in enumerate(need)})
        self._made = (step, made)
        reused = [pid for pid in prompt_ids if pid in have]
        out = torch.cat([made[pid][0] for pid in prompt_ids]) if prompt_ids else torch.zeros(0, self.max_new,
                                                                                            dtype=torch.long)
        batch = score(self.task, self.vocab, cfg.seed, step, prompt_ids, g, out)
        return Sampled(batch, {"reused_prompts": len(reused)} if reused else {},
                       reused_s=sum(have[pid][1] for pid in reused))

    def before_save(self, done: int, state: dict[str, Any], frontier: int) -> None:
        pass

    def close(self) -> None:
        pass


class FleetSampling:
    """Rank 0 drives the rollout fleet; every rank gets its share by broadcast (module docstring).

    Rank 0 of each round drives: :meth:`regroup` connects a new rank 0 to the fleet. A driver that
    stays rank 0 across a round change in place keeps its fleet, its published weights and the
    steps it submitted ahead, and serves a step trained again (its collectives failed after the
    completions came) from the completions it collected for it."""

    def __init__(self, cfg: GRPOConfig, task: Task, vocab: Vocab | TokenizerVocab, model: torch.nn.Module,
                 max_new: int, *, job_id: str) -> None:
        self.cfg, self.task, self.vocab, self.model, self.max_new = cfg, task, vocab, model, max_new
        self.job_id = job_id
        self.rank, self.distributed = 0, False
        self._wait: Callable[[Any], None] = lambda work: work.wait()
        self.k = cfg.rollout.max_off_policy_steps
        self.per_step = cfg.prompts_per_step
        self.fleet = None
        self._published = -1
        self._next: int | None = None
        """The step the driver's fleet samples next (None: not started)."""
        self._last: tuple[int, torch.Tensor, torch.Tensor] | None = None
        """The last step the driver collected: (step, header, block), for a step trained again."""

    def regroup(self, rank: int, distributed: bool, wait: Callable[[Any], None]) -> bool:
        """Take this round's place (collective): a rank 0 without a fleet connects to it. Returns,
        on every rank, whether completions sampled ahead were lost with the driver (a new rank 0
        and ``max_off_policy_steps > 0``): the steps ahead were sampled with weights that only the
        lost driver knew, so the job must go on from a checkpoint, whose state holds them."""
        self.rank, self.distributed, self._wait = rank, distributed, wait
        error = ""
        if rank == 0 and self.fleet is None:
            error = self._connect(self.job_id)
        elif rank != 0 and self.fleet is not None:  # ranks keep their order: a driver stays rank 0 or goes
            self.close()
            self.fleet, self._next, self._last = None, None, None
        # A rank 0 whose fleet has not started yet (connected now, or in an agreement a fault cut
        # short) has none of the samples ahead.
        return self._agree(error, extra=1.0 if rank == 0 and self.k and self._next is None else 0.0) > 0

    def _connect(self, job_id: str) -> str:
        from ftrt.rollout.fleet import Fleet
        from ftrt.policy.spec import PolicySpec
        from ftrt.store.access import EtcdTarget, from_env
        from ftrt.store.sync import SyncStore

        ro, rt = self.cfg.rollout, ftrt.init()
        job = ro.job_id or (job_id if rt.launched_by_ftrt else "")
        # The fleet's etcd: the one rollout.etcd names (a connection of its own), else the job's (shared).
        own = SyncStore(EtcdTarget(ro.etcd, from_env()), name="ftrt-fleet") if ro.etcd else None
        store = own or rt.etcd_store()
        if store is None or not job:
            if own is not None:
                own.close()
            return ("rollout.mode=fleet needs the job's etcd and id: run under ftrt launch, or set rollout.etcd "
                    "and rollout.job_id.")
        endpoints = store.target.endpoints
        try:
            self.fleet = Fleet(store=store, own_store=own is not None, job_id=job, spec=PolicySpec.of(self.cfg),
                               vocab_size=output_size(self.model, len(self.vocab)), max_new=self.max_new,
                               request_timeout=ro.request_timeout, wait_timeout=ro.wait_timeout,
                               push_timeout=ro.push_timeout)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others hang
            return f"Cannot reach the rollout fleet of job {job} at {endpoints}: {exc}"
        print(f"[ftrt.grpo] rollout fleet of job {job}: prompt groups go to `ftrt rollout serve --etcd "
              f"{endpoints} --job-id {job}` servers (off-policy steps {self.k})", flush=True)
        return ""

    def _agree(self, error: str, extra: float = 0.0) -> float:
        """Raise on every rank if rank 0 failed (the others would wait in the next collective); rank
        0's ``extra`` is returned on every rank."""
        flag = torch.tensor([1.0 if error else 0.0, extra], dtype=torch.float64)
        if self.distributed:
            self._wait(dist.broadcast(flag, 0, async_op=True))
        if flag[0].item():
            raise ConfigError(error or "Rank 0 could not reach the rollout fleet; see its error.")
        return flag[1].item()

    def version_of(self, step: int) -> int:
        return max(0, step - self.k)

    def prompts(self, frontier: int, step: int, first: int) -> list[int]:
        """Step ``first``'s prompt ids, given that step ``step`` starts at ``frontier``."""
        lo = frontier + (first - step) * self.per_step
        return list(range(lo, lo + self.per_step))

    def state(self) -> dict[str, Any]:
        """The checkpoint's share: the completions of the K steps sampled ahead of the trained one."""
        if not self.k:
            return {}
        g, n = self.cfg.group_size, self.max_new
        return {"ahead": torch.zeros(self.k, self.per_step, g, n, dtype=torch.long), "ahead_from": -1}

    def start(self, step: int, state: dict[str, Any], frontier: int) -> None:
        """Publish the weights of ``step`` and submit what the first steps need (rank 0; every rank
        learns whether that worked)."""
        error = ""
        if self.fleet is not None and step != self._next and (self._last is None or self._last[0] != step):
            try:
                if self._next is not None:  # the job went back to a checkpoint: the fleet's ledger is ahead
                    self.fleet.close()
                    self.fleet, self._published, self._last = None, -1, None
                    error = self._connect(self.job_id)
                if not error:
                    self._start(step, state, frontier)
                    self._next = step
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others hang
                error = str(exc)
        self._agree(error)

    def _start(self, step: int, state: dict[str, Any], frontier: int) -> None:
        self._publish(step)
        ahead = state.get("ahead_from", -1)
        for s in range(step, min(step + self.k, self.cfg.steps)):
            pids = self.prompts(frontier, step, s)
            if ahead == step:
                block = state["ahead"][s - step]
                self.fleet.seed(s, {pid: block[i].clone() for i, pid in enumerate(pids)}, self.version_of(s))
            elif self.version_of(s) == step:
                self.fleet.submit(s, pids, self.version_of(s))
            else:
                raise ConfigError(
                    f"The checkpoint at step {step} holds no samples for the {self.k} step(s) ahead that "
                    f"rollout.max_off_policy_steps={self.k} needs (it was saved with another setting); resume "
                    "with the setting it was saved with.")

    def _publish(self, version: int) -> None:
        if self._published != version:
            self.fleet.publish(version, self.model.state_dict(), keep_from=self.version_of(version))
            self._published = version

    def sample(self, step: int, prompt_ids: list[int], frontier: int) -> Sampled:
        g, n = self.cfg.group_size, self.max_new
        header = torch.zeros(5, dtype=torch.float64)
        block = torch.zeros(self.per_step, g, n, dtype=torch.long)
        error = ""
        if self.fleet is not None and self._last is not None and self._last[0] == step:
            _, header, block = self._last  # trained again: its completions came already
            header = header.clone()
            header[3:5] = 0.0  # no push and no wait for completions in this attempt
        elif self.fleet is not None:
            try:
                t0 = time.perf_counter()
                self._publish(step)
                nxt = step + self.k  # K = 0: this step itself
                if nxt < self.cfg.steps:
                    self.fleet.submit(nxt, self.prompts(frontier, step, nxt), self.version_of(nxt))
                results, redone = self.fleet.collect(step)
                rollout_s = time.perf_counter() - t0
                # this step's weights, to every server that took them; with K >= 1 that push may still be on
                # its way (nothing waits for it yet): then the previous version's, which is done
                pushed = self.fleet.push_stats(step)
                push_s = (pushed if pushed.servers else self.fleet.push_stats(step - 1)).seconds
                for i, pid in enumerate(self.prompts(frontier, step, step)):
                    block[i] = results[pid]
                header = torch.tensor([1.0, redone, self.fleet.live, push_s, rollout_s], dtype=torch.float64)
                self._last, self._next = (step, header, block), step + 1
            except Exception as exc:  # noqa: BLE001 - rank 0's error reaches every rank
                error = str(exc)
        if self.distributed:
            self._wait(dist.broadcast(header, 0, async_op=True))
            self._wait(dist.broadcast(block, 0, async_op=True))
        if header[0].item() != 1.0:
            raise ConfigError(error or "Rank 0 lost the rollout fleet; see its error.")
        lo = prompt_ids[0] - frontier if prompt_ids else 0
        out = block[lo:lo + len(prompt_ids)].reshape(len(prompt_ids) * g, n)
        batch = score(self.task, self.vocab, self.cfg.seed, step, prompt_ids, g, out)
        _, redone, live, push_s, rollout_s = header.tolist()
        return Sampled(batch, {"weight_version": self.version_of(step), "rollout_servers": int(live),
                               "redispatched": int(redone), "push_s": push_s, "rollout_s": rollout_s})

    def before_save(self, done: int, state: dict[str, Any], frontier: int) -> None:
        """Put the completions of steps ``done .. done+K-1`` into ``state`` (waiting for them)."""
        if not self.k:
            return
        ahead = state["ahead"]
        ahead.zero_()
        error = ""
        if self.fleet is not None:
            try:
                for s in range(done, min(done + self.k, self.cfg.steps)):
                    results, _ = self.fleet.collect(s, keep=True)
                    for i, pid in enumerate(self.prompts(frontier, done, s)):
                        ahead[s - done, i] = results[pid]
            except Exception as exc:  # noqa: BLE001
                error = str(exc)
        self._agree(error)
        if self.distributed:
            self._wait(dist.broadcast(ahead, 0, async_op=True))
        state["ahead_from"] = done

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
