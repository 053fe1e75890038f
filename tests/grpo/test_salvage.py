"""How a step trained again in place splits its prompts around the gradients kept from its failed attempt."""

from __future__ import annotations

import pytest

from ftrt.grpo.salvage import Salvage, claim, plan_shares, rows_to_compute, shard


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
    with pytest.raises(ValueError, match="Ranks 0 and 1 both hold a gradient of prompt 1"):
        plan_shares(6, 2, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="Rank 0 holds a gradient of prompt 6, outside"):
        plan_shares(6, 2, [(6,), ()])
    with pytest.raises(ValueError, match="one claim per rank"):
        plan_shares(6, 2, [()])


def test_a_rank_claims_its_kept_prompts_only_for_the_agreed_step_and_computes_the_rest():
    held = Salvage(step=8, prompts=(0, 1, 2), loss=0.5, kl=0.0, compute_s=0.2)
    assert claim(held, 8) == (0, 1, 2)
    assert claim(held, 7) == () and claim(held, -1) == () and claim(None, 8) == ()  # rolled back, restored
    # prompts 3 and 5 of [0, 3, 1, 5] are left, 2 rows each
    assert rows_to_compute([0, 3, 1, 5], (0, 1), 2) == ([1, 3], [2, 3, 6, 7])
    assert rows_to_compute([0, 1], (0, 1), 4) == ([], [])
