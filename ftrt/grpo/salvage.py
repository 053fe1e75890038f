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

from dataclasses import dataclass


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
        raise ValueError(f"plan_shares needs one claim per rank ({world}), got {len(claims)}")
    owner: dict[int, int] = {}
    for rank, claim in enumerate(claims):
        for p in claim:
            if not 0 <= p < n or p in owner:
                raise ValueError(f"prompt {p} is claimed twice or lies outside the step's {n} prompts")
            owner[p] = rank
    usual = [shard(n, world, r) for r in range(world)]
    if all(lo <= p < hi for claim, (lo, hi) in zip(claims, usual) for p in claim):
        return [list(range(lo, hi)) for lo, hi in usual]
    free = [p for p in range(n) if p not in owner]
    shares = [sorted(claim) for claim in claims]
    for rank in range(world):
        lo, hi = shard(len(free), world, rank)
        shares[rank] = sorted(shares[rank] + free[lo:hi])
    return shares


__all__ = ["Salvage", "plan_shares", "shard"]
