"""The policy worker of the GRPO trainer on Ray (:mod:`ftrt.grpo.ray`): one data-parallel rank of an
elastic group (:class:`ftrt.integrations.ray.ElasticGroup`), called by the driver.

The driver owns the loop and the data, as a veRL or OpenRLHF driver does: for each step it asks
the group to :meth:`PolicyWorker.generate` the step's prompts (each rank samples its share with the
current weights), scores nothing itself but computes the group advantages from the rewards the
workers return, then asks the group to :meth:`PolicyWorker.update` on the whole step's rollout
(each rank takes its share at the world size the update runs at).

The update is the one ``ftrt launch -m ftrt.grpo`` makes (:func:`ftrt.grpo.loss.policy_loss`, global
token and sequence counts, gradients summed over the ranks), with the same shares and seeds, so at
the same world size the two learn bit for bit alike.

A method may run again after a world change (:mod:`ftrt.integrations.ray.worker`): generating is a
pure function of the weights and the seeds; an update the agreed state already holds returns that
update's result (kept in the state, so a newcomer has it too) instead of applying it twice.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import ftrt
from ftrt import _diag
from ftrt.errors import ConfigError, FtrtError, WorldChanged
from ftrt.grpo.config import GRPOConfig
from ftrt.grpo.loss import policy_loss
from ftrt.grpo.salvage import shard
from ftrt.grpo.sampling import LocalSampling
from ftrt.inplace import sync_state_dict
from ftrt.policy.model import param_count
from ftrt.policy.sample import completion_mask, make_prompts
from ftrt.policy.setting import build_setting

if TYPE_CHECKING:
    from ftrt.checkpoint.checkpointer import Checkpointer

Rollout = tuple[int, torch.Tensor, torch.Tensor, int]
"""One prompt's group as :meth:`PolicyWorker.generate` returns it: (prompt id, completions (G, N)
token ids, rewards (G,), completion tokens that count)."""
Scored = tuple[int, torch.Tensor, torch.Tensor]
"""One prompt's group as :meth:`PolicyWorker.update` takes it: (prompt id, completions, advantages (G,))."""

HOLD_TIMEOUT_S = 120.0
"""The longest a worker holds at a diagnostic hold point (tests) waiting for a new round."""


class PolicyWorker:
    """See the module docstring. ``config``: the run's :class:`GRPOConfig` as a dict."""

    process_group_backend = "gloo"
    """The policy, its state agreement and its all-reduces are on the CPU, as the launched trainer's."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = cfg = GRPOConfig.model_validate(config)
        self.rt = ftrt.init()
        torch.set_num_threads(cfg.threads)
        built = build_setting(cfg.model, cfg.task, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens)
        self.task, self.vocab, self.model = built.task, built.vocab, built.model
        self.max_new, self.prompt_len = built.max_new, built.prompt_len
        self.ref = copy.deepcopy(self.model).requires_grad_(False) if cfg.kl_beta > 0 else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sampling = LocalSampling(cfg, self.task, self.vocab, self.model, self.max_new)
        self.state: dict[str, Any] = {
            "model": self.model, "optim": self.opt,
            "trainer": {"step": 0, "frontier": 0, "tokens": 0, "resumes": 0},
            "last": {},
        }
        self.holds = False
        """Whether ``state`` is one the job had after a whole step (received, restored or trained):
        False for a newcomer, while a step of several ``ppo_epochs`` is half applied, and for the
        initial state, which every rank builds alike (offering it would make the state agreement
        materialise the optimizer's state, an extra step in its count)."""
        self.moved = False
        """Whether this process's state left the initial one (trained, received or restored)."""
        self._ck: Checkpointer | None = None
        """This round's checkpointer (a new one each round: the old one's process groups are gone)."""

    @property
    def trainer(self) -> dict[str, int]:
        return self.state["trainer"]

    # -- the group's hook ------------------------------------------------------------------------
    def on_world_change(self) -> None:
        """Agree on the newest whole state (a newcomer, or a rank a step behind, gets it); when no rank
        holds one (the job's start, or every rank half through a step) restore the newest checkpoint."""
        cfg = self.cfg
        if self._ck is not None:
            self._ck.retire()
            self._ck = None
        if cfg.checkpoint.url:
            self._ck = self.rt.checkpointer(cfg.checkpoint.url, keep=cfg.checkpoint.keep,
                                            storage_options=cfg.checkpoint.storage_options)
        applied = self.trainer["step"] if self.holds else -1
        try:
            synced = sync_state_dict(applied, self.state, wait=self.rt.wait)
        except WorldChanged:
            raise  # a peer lost in a collective: this rank's state is its own or, taken whole, the sender's
        except BaseException:
            self.holds = False
            raise
        if synced < 0:
            restored = self._ck.restore(self.state) if self._ck is not None else None
            if restored is not None:
                self.trainer["resumes"] += 1
                self.holds = self.moved = True
            elif self.moved:
                raise FtrtError("The ranks lost the state of the step in flight (every rank was half through a "
                                "step of several ppo_epochs) and there is no checkpoint to go back to. Set "
                                "checkpoint.url to go back to a checkpoint in place.")
            # else: no rank trained yet; every rank holds the initial state, built alike
        else:
            self.holds = self.moved = True

    # -- what the driver calls -------------------------------------------------------------------
    def position(self) -> dict[str, Any]:
        """Where the agreed state is: the next step, the data frontier, tokens trained, resumes, and
        the policy's size (the driver resumes its loop from here)."""
        return {**self.trainer, "params": param_count(self.model)}

    def generate(self, step: int, prompt_ids: list[int]) -> list[Rollout]:
        """Sample and score this rank's share of ``prompt_ids`` (contiguous, as ``ftrt launch -m
        ftrt.grpo`` splits them) with the current weights, which must be step ``step``'s."""
        self._check_at(step, "generate")
        rank, world = dist.get_rank(), dist.get_world_size()
        lo, hi = shard(len(prompt_ids), world, rank)
        mine = list(prompt_ids[lo:hi])
        batch = self.sampling.sample(step, mine, self.trainer["frontier"]).batch
        g, n = self.cfg.group_size, self.prompt_len
        return [(pid, batch.sequences[i * g:(i + 1) * g, n:].clone(), batch.rewards[i].clone(),
                 int(batch.mask[i * g:(i + 1) * g].sum())) for i, pid in enumerate(mine)]

    def update(self, step: int, rollout: list[Scored], total_tokens: float) -> dict[str, Any]:
        """Apply step ``step`` on the whole step's ``rollout`` (this rank trains its contiguous share at
        the current world size; ``total_tokens``: the rollout's completion tokens that count). Returns
        the step's global result: the summed loss and KL, the gradient norm, the world size."""
        cfg, tr = self.cfg, self.trainer
        last = self.state["last"]
        if step < tr["step"] and last.get("step") == step:
            return dict(last)  # applied already (this call runs again after a world change)
        self._check_at(step, "update")
        rank, world = dist.get_rank(), dist.get_world_size()
        lo, hi = shard(len(rollout), world, rank)
        mine = rollout[lo:hi]
        sequences, mask, adv = self._batch(mine)
        total_seqs = float(len(rollout) * cfg.group_size)
        loss_value = kl_sum = 0.0
        old = ref_logp = None
        for epoch in range(cfg.ppo_epochs):
            if epoch:
                self._apply()
            self.opt.zero_grad(set_to_none=False)
            if mask.shape[0]:
                pl = policy_loss(cfg, self.model, self.ref, sequences, mask, adv, prompt_len=self.prompt_len,
                                 max_len=self.max_new, total_tokens=total_tokens, total_seqs=total_seqs,
                                 old_logp=old, ref_logp=ref_logp)
                old, ref_logp, kl_sum = pl.old_logp, pl.ref_logp, pl.kl_sum
                pl.loss.backward()
                loss_value = float(pl.loss.detach())
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            self._hold("grad_reduce", step)
            self.rt.wait(dist.all_reduce(flat, async_op=True))
            off = 0
            for p in self.params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        sums = torch.tensor([loss_value, kl_sum], dtype=torch.float64)
        self.rt.wait(dist.all_reduce(sums, async_op=True))
        grad_norm = self._apply()  # no collective from here to the counters
        tr.update(step=step + 1, frontier=tr["frontier"] + len(rollout), tokens=tr["tokens"] + int(total_tokens))
        loss_total, kl_total = sums.tolist()
        self.state["last"] = {"step": step, "loss": loss_total, "kl": kl_total / max(total_tokens, 1.0),
                              "grad_norm": grad_norm, "world_size": world, "round": self.rt.round}
        self.holds = True
        return dict(self.state["last"])

    def save(self, step: int) -> float:
        """Checkpoint the state after step ``step - 1`` to ``checkpoint.url`` (collective); returns
        the seconds the save took, for the driver's cadence."""
        if self._ck is None:
            raise ConfigError("save needs checkpoint.url: the run has no checkpoint storage.")
        if step != self.trainer["step"]:
            raise FtrtError(f"save of step {step} asked, but the state is at step {self.trainer['step']}.")
        t0 = time.perf_counter()
        self._ck.save(step, self.state).wait()
        return time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for this rank's saves and close its checkpointer (before the group closes)."""
        if self._ck is not None:
            self._ck.close()

    def weights(self) -> list[float]:
        """The policy's parameters, flat (tests compare ranks and runs)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params]).tolist()

    # -- inside -----------------------------------------------------------------------------------
    def _check_at(self, step: int, what: str) -> None:
        if step != self.trainer["step"]:
            raise FtrtError(f"{what} of step {step} asked, but the agreed state is at step {self.trainer['step']}: "
                            "the driver calls the steps in order, from position()['step'].")

    def _batch(self, mine: list[Scored]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences, completion mask and advantages of this rank's groups, built as
        :func:`ftrt.policy.sample.score` builds a rank's batch."""
        g = self.cfg.group_size
        prompts, _ = make_prompts(self.task, self.vocab, self.cfg.seed, [pid for pid, _, _ in mine])
        out = torch.cat([c for _, c, _ in mine]) if mine else torch.zeros(0, self.max_new, dtype=torch.long)
        adv = torch.cat([a for _, _, a in mine]) if mine else torch.zeros(0)
        sequences = torch.cat([prompts.repeat_interleave(g, dim=0), out], dim=1)
        return sequences, completion_mask(out, self.vocab.eos), adv

    def _apply(self) -> float:
        """One optimizer step on the summed gradients (clipped); their global norm before clipping."""
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params])
        self.holds = False  # until the step's counters follow
        self.opt.step()
        self.moved = True
        return float(norm)

    def _hold(self, point: str, step: int) -> None:
        """Tests (``FTRT_DIAG_HOLD=POINT:STEP``): wait here, once, until a new round is waiting."""
        if not _diag.holds_at(point, step):
            return
        _diag.mark("held", point=point, step=step)
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while time.monotonic() < deadline and not self.rt.world_changed():
            self.rt.heartbeat(step)
            time.sleep(0.05)

