"""Rollouts: G completions per prompt, sampled in one batch with a KV cache.

Randomness never comes from a process's RNG stream: completion ``j`` of prompt ``i`` at step
``s`` draws its uniforms from a generator seeded by ``(seed, s, i, j)`` and picks tokens by
inverse CDF. Which rank samples it, in which batch, after how many restarts, does not matter.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ftrt.policy.tasks import Task, Vocab, prompt_rng


def sample_seed(seed: int, step: int, prompt_id: int, sample_idx: int) -> int:
    digest = hashlib.blake2b(f"ftrt-sample/{seed}/{step}/{prompt_id}/{sample_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def uniforms(seed: int, step: int, prompt_ids: list[int], group: int, length: int) -> torch.Tensor:
    """(len(prompt_ids) * group, length) uniforms in [0, 1), row ``i * group + j`` for (prompt i, sample j)."""
    rows = []
    g = torch.Generator()
    for pid in prompt_ids:
        for j in range(group):
            g.manual_seed(sample_seed(seed, step, pid, j))
            rows.append(torch.rand(length, generator=g, dtype=torch.float64))
    return torch.stack(rows) if rows else torch.empty(0, length, dtype=torch.float64)


def pick(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sample one token per row from ``softmax(logits / T)`` with the given uniforms (inverse CDF)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    idx = (cdf < (u * cdf[:, -1]).unsqueeze(1)).sum(dim=-1)
    return idx.clamp(max=logits.shape[-1] - 1)


@dataclass
class Batch:
    prompt_ids: list[int]
    answers: list[list[str]]
    prompts: torch.Tensor  # (P, Lp) token ids, BOS ... SEP
    sequences: torch.Tensor  # (P*G, Lp + N): prompt then completion (PAD after EOS)
    mask: torch.Tensor  # (P*G, N) bool: completion tokens that count (up to and including EOS)
    rewards: torch.Tensor  # (P, G)


def make_prompts(task: Task, vocab: Vocab, seed: int, prompt_ids: list[int]) -> tuple[torch.Tensor, list[list[str]]]:
    rows, answers = [], []
    for pid in prompt_ids:
        prompt, answer = task.make(prompt_rng(seed, pid))
        rows.append([vocab.bos, *vocab.encode(prompt), vocab.sep])
        answers.append(answer)
    if not rows:
        return torch.empty(0, task.prompt_len + 2, dtype=torch.long), answers
    return torch.tensor(rows, dtype=torch.long), answers


@torch.no_grad()
def complete(model: torch.nn.Module, vocab: Vocab, prompts: torch.Tensor, u: torch.Tensor, *, group: int,
             max_new: int, temperature: float) -> torch.Tensor:
    """Completion tokens (P*G, max_new) for ``prompts`` (P, Lp), ``group`` rows per prompt drawn
    with the uniforms ``u`` (row ``i * group + j``); PAD after a row's EOS."""
    seq = prompts.repeat_interleave(group, dim=0)
    n = seq.shape[0]
    out = torch.full((n, max_new), vocab.pad, dtype=torch.long)
    if not n:
        return out
    done = torch.zeros(n, dtype=torch.bool)
    logits, cache = model(seq)
    last = logits[:, -1]
    start = seq.shape[1]
    for t in range(max_new):
        tok = pick(last, u[:, t], temperature)
        tok = torch.where(done, torch.full_like(tok, vocab.pad), tok)
        out[:, t] = tok
        done = done | (tok == vocab.eos)
        if bool(done.all()) or t == max_new - 1:
            break
        logits, cache = model(tok.unsqueeze(1), cache, start + t)
        last = logits[:, -1]
    return out


def completion_mask(out: torch.Tensor, eos: int) -> torch.Tensor:
    """The completion tokens that count: every one up to and including a row's first EOS."""
    ended = (out == eos).long().cumsum(dim=1)
    return (ended - (out == eos).long()) == 0


def score(task: Task, vocab: Vocab, seed: int, step: int, prompt_ids: list[int], group: int,
          out: torch.Tensor) -> Batch:
    """The :class:`Batch` of completions ``out`` (P*G, N) of ``prompt_ids``: sequences, mask and rewards."""
    prompts, answers = make_prompts(task, vocab, seed, prompt_ids)
    n = len(prompt_ids) * group
    rewards = torch.tensor(
        [task.reward(answers[i // group], vocab.decode_completion(out[i].tolist())) for i in range(n)],
        dtype=torch.float32,
    ).view(len(prompt_ids), group)
    seq = prompts.repeat_interleave(group, dim=0)
    return Batch(prompt_ids, answers, prompts, torch.cat([seq, out], dim=1), completion_mask(out, vocab.eos), rewards)


@torch.no_grad()
def rollout(model: torch.nn.Module, task: Task, vocab: Vocab, *, seed: int, step: int, prompt_ids: list[int],
            group: int, max_new: int, temperature: float) -> Batch:
    """Sample ``group`` completions for each prompt and score them."""
    prompts, _ = make_prompts(task, vocab, seed, prompt_ids)
    u = uniforms(seed, step, prompt_ids, group, max_new)
    out = complete(model, vocab, prompts, u, group=group, max_new=max_new, temperature=temperature)
    return score(task, vocab, seed, step, prompt_ids, group, out)


def sample_group(model: torch.nn.Module, task: Task, vocab: Vocab, *, seed: int, step: int, prompt_id: int,
                 group: int, max_new: int, temperature: float) -> torch.Tensor:
    """One prompt group's completions (G, max_new), sampled on their own: the forward batch is
    always exactly this group, so the tokens are a pure function of (seed, step, prompt_id,
    weights), whatever else the caller is sampling (the rollout fleet's unit of work)."""
    prompts, _ = make_prompts(task, vocab, seed, [prompt_id])
    u = uniforms(seed, step, [prompt_id], group, max_new)
    return complete(model, vocab, prompts, u, group=group, max_new=max_new, temperature=temperature)


def token_logps(model: torch.nn.Module, sequences: torch.Tensor, prompt_len: int,
                temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the completion tokens (B, N) under ``model`` at the sampling
    temperature (the distribution they were drawn from; differentiable)."""
    logits, _ = model(sequences[:, :-1])
    logits = logits[:, prompt_len - 1:] / temperature
    targets = sequences[:, prompt_len:]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
