"""How a step trained again in place splits its prompts around the gradients kept from its failed attempt."""

from __future__ import annotations

import pytest

from ftrt.grpo.salvage import plan_shares, shard


def usual(n: int, world: int) -> list[list[int]]:
    return [list(range(*shard(n, world, r))) for r in range(world)]


def test_claims_within_the_usual_shares_keep_the_usual_shares():
    # A worker replaced at the same world size: the survivors hold exactly their shares, the newcomer nothing.
    assert plan_shares(6, 2, [(0, 1, 2), ()]) == usual(6, 2)
    assert plan_shares(64, 3, [tuple(range(22)), (), tuple(range(43, 64))]) == usual(64, 3)
    # 3 -> 2 where the survivors' old shares lie inside their new ones (rank 1 of 3 lost).
    assert plan_shares(64, 2, [tuple(range(22)), tuple(range(43, 64))]) == usual(64, 2)


def test_other_claims_are_kept_and_the_rest_is_split_evenly():
    # 3 -> 2, the old rank 2 became rank 0: each keeps what it computed, the lost rank's 21 prompts split 11/10.
    old0, old2 = tuple(range(22)), tuple(range(43, 64))
    shares = plan_shares(64, 2, [old2, old0])
    assert shares == [sorted([*old2, *range(22, 33)]), sorted([*old0, *range(33, 43)])]
    assert sorted(p for s in shares for p in s) == list(range(64))
    # A lone survivor takes everything; a newcomer beside a survivor takes only new work.
    assert plan_shares(6, 1, [(3, 4, 5)]) == [list(range(6))]
    assert plan_shares(6, 2, [(), (0, 1, 2)]) == [[3, 4], [0, 1, 2, 5]]


def test_overlapping_or_foreign_claims_are_refused():
    with pytest.raises(ValueError, match="claimed twice"):
        plan_shares(6, 2, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="outside"):
        plan_shares(6, 2, [(6,), ()])
    with pytest.raises(ValueError, match="one claim per rank"):
        plan_shares(6, 2, [()])
