"""Rank 0's metrics file in place: one line per step, whoever was rank 0 when the step ended."""

from __future__ import annotations

import json

from ftrt.grpo.trainer import Metrics


def steps(path) -> list[tuple[int, int]]:
    return [(x["step"], x["round"]) for x in map(json.loads, path.read_text().splitlines())]


def test_a_late_line_of_an_older_round_is_dropped_and_a_step_trained_again_later_replaces_it(tmp_path):
    path = tmp_path / "m.jsonl"
    m = Metrics(str(path))
    for s in range(3):
        m.append({"step": s, "round": 1})
    m.append({"step": 2, "round": 1})  # the same step again from the same round: recorded already
    m.append({"step": 1, "round": 1})  # an older step: never written twice
    assert steps(path) == [(0, 1), (1, 1), (2, 1)]
    m.append({"step": 2, "round": 2})  # step 2 trained again in round 2 (rank 0 was rolled back)
    assert steps(path) == [(0, 1), (1, 1), (2, 2)]
    m.append({"step": 3, "round": 3})
    m.append({"step": 3, "round": 2})  # a rank 0 that lost its round writes late: dropped
    assert steps(path) == [(0, 1), (1, 1), (2, 2), (3, 3)]


def test_settle_drops_steps_the_agreed_state_lacks_and_adds_the_one_the_lost_rank_0_did_not_write(tmp_path):
    path = tmp_path / "m.jsonl"
    m = Metrics(str(path))
    for s in range(4):
        m.append({"step": s, "round": 1})
    assert m.settle(3, {"step": 2, "round": 1}) == 1  # step 3 is trained again; step 2 is there
    assert steps(path) == [(0, 1), (1, 1), (2, 1)]
    assert m.settle(4, {"step": 3, "round": 1}) == 0  # rank 0 died before it wrote step 3
    assert steps(path) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert Metrics(None).settle(4, {"step": 3}) == 0  # not rank 0
