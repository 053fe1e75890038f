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
from typing import Any

import torch
import torch.distributed as dist

import ftrt
from ftrt.errors import ConfigError
from ftrt.grpo.config import GRPOConfig
from ftrt.policy.sample import Batch, rollout, score
from ftrt.policy.tasks import Task, TokenizerVocab, Vocab


@dataclass(frozen=True)
class Sampled:
    """A rank's share of a step and what getting it cost."""

    batch: Batch
    info: dict[str, Any]
    """Metrics-line fields (fleet: weight_version, rollout_servers, redispatched, push_s, rollout_s)."""


def output_size(model: torch.nn.Module, fallback: int) -> int:
    """How many token ids the policy can sample (its output layer's width; a Hugging Face model's
    may exceed its tokenizer's vocabulary)."""
    lm = getattr(model, "lm", None)
    size = getattr(getattr(lm, "config", None), "vocab_size", None) if lm is not None else None
    head = getattr(model, "head", None)
    return int(size or (head.out_features if head is not None else fallback))


class LocalSampling:
    """Each rank samples its own prompts with the current weights."""

    def __init__(self, cfg: GRPOConfig, task: Task, vocab: Vocab | TokenizerVocab, model: torch.nn.Module,
                 max_new: int) -> None:
        self.cfg, self.task, self.vocab, self.model, self.max_new = cfg, task, vocab, model, max_new

    def state(self) -> dict[str, Any]:
        return {}

    def start(self, step: int, state: dict[str, Any], frontier: int) -> None:
        pass

    def sample(self, step: int, prompt_ids: list[int], frontier: int) -> Sampled:
        cfg = self.cfg
        return Sampled(rollout(self.model, self.task, self.vocab, seed=cfg.seed, step=step, prompt_ids=prompt_ids,
                               group=cfg.group_size, max_new=self.max_new, temperature=cfg.temperature), {})

    def before_save(self, done: int, state: dict[str, Any], frontier: int) -> None:
        pass

    def close(self) -> None:
        pass


class FleetSampling:
    """Rank 0 drives the rollout fleet; every rank gets its share by broadcast (module docstring)."""

    def __init__(self, cfg: GRPOConfig, task: Task, vocab: Vocab | TokenizerVocab, model: torch.nn.Module,
                 max_new: int, *, rank: int, distributed: bool, job_id: str) -> None:
        self.cfg, self.task, self.vocab, self.model, self.max_new = cfg, task, vocab, model, max_new
        self.rank, self.distributed = rank, distributed
        self.k = cfg.rollout.max_off_policy_steps
        self.per_step = cfg.prompts_per_step
        self.fleet = None
        self._published = -1
        error = ""
        if rank == 0:
            error = self._connect(job_id)
        self._agree(error)

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

    def _agree(self, error: str) -> None:
        """Raise on every rank if rank 0 failed (the others would wait in the next collective)."""
        flag = torch.tensor([1.0 if error else 0.0], dtype=torch.float64)
        if self.distributed:
            dist.broadcast(flag, 0)
        if flag.item():
            raise ConfigError(error or "Rank 0 could not reach the rollout fleet; see its error.")

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
        if self.fleet is not None:
            try:
                self._start(step, state, frontier)
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
        if self.fleet is not None:
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
            except Exception as exc:  # noqa: BLE001 - rank 0's error reaches every rank
                error = str(exc)
        if self.distributed:
            dist.broadcast(header, 0)
            dist.broadcast(block, 0)
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
            dist.broadcast(ahead, 0)
        state["ahead_from"] = done

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
