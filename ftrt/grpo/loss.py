"""The GRPO objective as small pure functions (tensors in, tensors out; no globals).

- :func:`group_advantages`: reward minus the group mean, optionally over the group's std;
- :func:`clipped_surrogate`: the PPO-clip per-token loss with separate low and high epsilons;
- :func:`k3_kl`: the k3 estimator of KL(policy || reference) per token;
- :func:`aggregate`: token-mean, sequence-mean or Dr. GRPO's constant-normaliser sum;
- :func:`policy_loss`: one optimizer pass's loss of a policy on a rollout, built from the above
  (what every GRPO trainer of ftrt computes: ``ftrt launch -m ftrt.grpo`` and the Ray driver's workers).

Aggregation takes its normalisers as arguments, so data-parallel ranks can pass the global token
and sequence counts: the sum of the ranks' gradients is then the one-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ftrt.grpo.config import GRPOConfig


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``rewards`` (prompts, G) -> advantages of the same shape."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_norm:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      eps_low: float, eps_high: float) -> torch.Tensor:
    """Per-token ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``; ``adv`` (B,) or (B, 1)."""
    a = adv.reshape(-1, 1) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * a, torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token ``exp(ref - logp) - (ref - logp) - 1`` (non-negative, unbiased for KL(pi||ref))."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *, total_tokens: float | None = None,
              total_seqs: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Reduce a (B, T) per-token quantity to a scalar over the tokens ``mask`` keeps.

    - ``token_mean``: sum / total tokens;
    - ``seq_mean``: each sequence's token mean, summed / total sequences;
    - ``dr_grpo``: sum / (total sequences x ``max_len``).

    ``total_tokens``/``total_seqs`` default to this batch's; pass global counts in data parallel.
    """
    m = mask.to(per_token.dtype)
    if mode == "token_mean":
        n = m.sum() if total_tokens is None else total_tokens
        return (per_token * m).sum() / max(float(n), 1.0)
    seqs = float(per_token.shape[0]) if total_seqs is None else float(total_seqs)
    if mode == "seq_mean":
        per_seq = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(seqs, 1.0)
    if mode == "dr_grpo":
        length = per_token.shape[1] if max_len is None else max_len
        return (per_token * m).sum() / max(seqs * length, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}: use token_mean, seq_mean or dr_grpo")


@dataclass(frozen=True)
class PolicyLoss:
    """One pass's loss (differentiable), with what the next pass of the same rollout reuses."""

    loss: torch.Tensor
    old_logp: torch.Tensor
    """The rollout's log-probabilities under the weights it was sampled with (the first pass's)."""
    ref_logp: torch.Tensor | None
    """Under the reference policy (None without one)."""
    kl_sum: float
    """The k3 KL summed over the kept tokens (0 without a reference policy)."""


def policy_loss(cfg: "GRPOConfig", model: torch.nn.Module, ref: torch.nn.Module | None, sequences: torch.Tensor,
                mask: torch.Tensor, adv: torch.Tensor, *, prompt_len: int, max_len: int, total_tokens: float,
                total_seqs: float, old_logp: torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None) -> PolicyLoss:
    """The clipped surrogate (plus ``kl_beta`` times the k3 KL to ``ref``) of ``model`` on the
    completions ``sequences`` (rows of prompt then completion; ``mask`` keeps the completion's
    tokens), aggregated with the global ``total_tokens``/``total_seqs``. ``old_logp``/``ref_logp``:
    the previous pass's (None on the first pass: computed here)."""
    from ftrt.policy.sample import token_logps

    logp = token_logps(model, sequences, prompt_len, cfg.temperature)
    old = logp.detach() if old_logp is None else old_logp
    per_token = clipped_surrogate(logp, old, adv, cfg.clip_eps_low, cfg.clip_eps_high)
    kl_sum = 0.0
    if ref is not None:
        if ref_logp is None:
            with torch.no_grad():
                ref_logp = token_logps(ref, sequences, prompt_len, cfg.temperature)
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + cfg.kl_beta * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = aggregate(per_token, mask, cfg.loss_agg, total_tokens=total_tokens, total_seqs=total_seqs, max_len=max_len)
    return PolicyLoss(loss, old, ref_logp, kl_sum)
