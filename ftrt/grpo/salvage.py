"""A step's work kept across a lost peer: the gradient a rank computed for the step in flight.

In place, a peer lost during a step's gradient all-reduce fails the step on every rank, and the
step is trained again in the next round. By then each surviving rank has already sampled its
prompts and run their forward and backward passes: its local gradient (still in ``p.grad``, the
all-reduce works on a copy) is the same one it would compute again, since no rank applied the
step and the samples are drawn per prompt. :class:`Salvage` records which prompts that gradient
covers; the ranks of the next round agree on who holds what, and :func:`plan_shares` splits the
step's prompts so that each rank keeps the prompts it holds and only the others are computed.

The loss's normalisers (the step's token and sequence counts) are all-reduced over every prompt
of the step, whatever the split, so a kept gradient adds to a new one exactly as the same prompts
in one pass would (up to rounding). A worker crash at an unchanged world size keeps the usual
split (every survivor's prompts are its usual share): the step is bit-identical to an
uninterrupted one.

Only for a step of one optimizer pass (``ppo_epochs == 1``) sampled by the ranks themselves
(``rollout.mode == "local"``); :func:`plan_shares` is a pure function of the agreed claims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Salvage:
    """What this rank's ``p.grad`` holds of step ``step`` while that step's all-reduce is in flight."""

    step: int
    prompts: tuple[int, ...]
    """The prompts (offsets within the step, ascending) whose summed gradient ``p.grad`` holds."""
    loss: float
    """This rank's loss over those prompts (already normalised by the step's global counts)."""
    kl: float
    """This rank's summed KL over those prompts' tokens."""
    compute_s: float
    """Seconds their forward and backward passes took (the step's work, done before the fault)."""


@dataclass(frozen=True)
class Redo:
    """Step ``step`` is trained again on gradients kept from its failed attempt: each rank's prompts."""

    step: int
    shares: list[list[int]]
    """Each rank's prompts (offsets within the step), from :func:`plan_shares`."""
    kept: int
    """How many of the step's prompts some rank holds a gradient of."""


def claim(held: Salvage | None, step: int) -> tuple[int, ...]:
    """The prompts whose gradient this rank holds for the agreed step ``step`` (-1: the ranks agreed
    on none, and restored a checkpoint): ``held``'s, when it is of that step."""
    return held.prompts if held is not None and step >= 0 and held.step == step else ()


def agree_on_redo(mine: tuple[int, ...], step: int, rank: int, world: int, prompts: int,
                  wait: Callable[[Any], None]) -> Redo | None:
    """Tell every rank which prompts of step ``step`` this rank holds a gradient of (``mine``) and
    learn theirs (one all-reduce of a ranks x prompts table over the round's group); the split for
    training the step again, or None when no rank holds one. Collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    table = torch.zeros(world, prompts, dtype=torch.int32)
    table[rank, list(mine)] = 1
    wait(dist.all_reduce(table, async_op=True))
    claims = [tuple(row.nonzero().flatten().tolist()) for row in table]
    kept = sum(len(c) for c in claims)
    return Redo(step, plan_shares(prompts, world, claims), kept) if kept else None


def rows_to_compute(offsets: list[int], kept: tuple[int, ...], group: int) -> tuple[list[int], list[int]]:
    """Of a batch of ``offsets``' prompts (``group`` rows each, in that order), the positions of the
    prompts not in ``kept`` and their rows: what is left to compute."""
    done = set(kept)
    todo = [i for i, o in enumerate(offsets) if o not in done]
    return todo, [i * group + j for i in todo for j in range(group)]


def shard(n: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's usual contiguous slice ``[lo, hi)`` of ``n`` items (the first ``n % world`` get one more)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def plan_shares(n: int, world: int, claims: list[tuple[int, ...]]) -> list[list[int]]:
    """Each rank's prompts (offsets in ``[0, n)``) for a step trained again, given what each rank
    holds a gradient for (``claims[rank]``, possibly empty).

    When every claim lies within its rank's usual share, the usual shares (a worker replaced at
    the same world size: bit-identical). Otherwise each rank keeps its claim and the unclaimed
    prompts are split in order into ``world`` near-equal runs (the first ranks one more), so the
    new work is balanced. Overlapping or out-of-range claims are a bug of the caller's agreement:
    ValueError.
    """
    if len(claims) != world or world < 1:
        raise ValueError(f"plan_shares needs one claim per rank ({world}), got {len(claims)}.")
    owner: dict[int, int] = {}
    for rank, held in enumerate(claims):
        for p in held:
            if not 0 <= p < n:
                raise ValueError(f"Rank {rank} holds a gradient of prompt {p}, outside the step's {n} prompts.")
            if p in owner:
                raise ValueError(f"Ranks {owner[p]} and {rank} both hold a gradient of prompt {p}.")
            owner[p] = rank
    usual = [shard(n, world, r) for r in range(world)]
    if all(lo <= p < hi for claim, (lo, hi) in zip(claims, usual) for p in claim):
        return [list(range(lo, hi)) for lo, hi in usual]
    free = [p for p in range(n) if p not in owner]
    shares = [sorted(held) for held in claims]
    for rank in range(world):
        lo, hi = shard(len(free), world, rank)
        shares[rank] = sorted(shares[rank] + free[lo:hi])
    return shares


__all__ = ["Redo", "Salvage", "agree_on_redo", "claim", "plan_shares", "rows_to_compute", "shard"]
