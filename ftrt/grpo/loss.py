"""The GRPO objective as small pure functions (tensors in, tensors out; no globals).

- :func:`group_advantages`: reward minus the group mean, optionally over the group's std;
- :func:`clipped_surrogate`: the PPO-clip per-token loss with separate low and high epsilons;
- :func:`k3_kl`: the k3 estimator of KL(policy || reference) per token;
- :func:`aggregate`: token-mean, sequence-mean or Dr. GRPO's constant-normaliser sum.

Aggregation takes its normalisers as arguments, so data-parallel ranks can pass the global token
and sequence counts: the sum of the ranks' gradients is then the one-process gradient.
"""

from __future__ import annotations

import torch


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
