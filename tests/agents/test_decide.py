"""Unit tests of the pure rendezvous decision, with a fake clock."""

from __future__ import annotations

from dataclasses import replace

from ftrt.agents.rendezvous.decide import Action, RendezvousConfig, View, decide_round
from ftrt.records import JobState, Member, NodeRecord, RestartRequest, RoundRecord


def node(name: str, rev: int, *, inc: str = "i0", ready: bool = True, done: int = 0) -> NodeRecord:
    return NodeRecord(
        node_id=name, incarnation=inc, host="127.0.0.1", agent_addr="127.0.0.1:1", nproc=1,
        ready=ready, done_round=done, revision=rev,
    )


def member(n: NodeRecord) -> Member:
    return Member(n.node_id, n.incarnation, n.nproc)


def view_of(*nodes: NodeRecord, round_: RoundRecord | None = None, **kw) -> View:
    v = View(nodes={n.node_id: n for n in nodes}, round=round_, **kw)
    for n in nodes:
        v.ready_since.setdefault(n.node_id, 0.0)
    return v


A, B, C, D = (node(x, i + 1) for i, x in enumerate("abcd"))
CFG = RendezvousConfig(min_nodes=2, max_nodes=3, settle_s=0.1, join_settle_s=0.3,
                       first_round_wait_s=1.0, join_timeout_s=30.0, max_restarts=2)
R1 = RoundRecord(round=1, members=(member(A), member(B), member(C)))


def test_first_round_waits_for_more_nodes_then_starts_with_the_ready_ones():
    v = view_of(A, B, waiting_since=0.0)
    d = decide_round(0.5, v, CFG)
    assert d.action is Action.WAIT and d.wake_at == 1.0
    d = decide_round(1.0, v, CFG)
    assert d.action is Action.WRITE_ROUND
    assert d.round.round == 1 and d.round.node_ids == ["a", "b"] and d.round.active


def test_first_round_starts_at_once_with_max_nodes_in_arrival_order():
    v = view_of(C, A, B, D)  # dict order differs from arrival (revision) order
    d = decide_round(0.0, v, CFG)
    assert d.action is Action.WRITE_ROUND
    assert d.round.node_ids == ["a", "b", "c"]
    assert d.round.world_size == 3


def test_nodes_not_ready_are_not_counted():
    v = view_of(A, replace(B, ready=False), waiting_since=0.0)
    d = decide_round(5.0, v, CFG)
    assert d.action is Action.WAIT and "1 of at least 2" in d.reason


def test_below_min_fails_after_the_join_timeout_with_a_clear_reason():
    v = view_of(A, waiting_since=10.0)
    assert decide_round(39.9, v, CFG).action is Action.WAIT
    d = decide_round(40.0, v, CFG)
    assert d.action is Action.FAIL
    assert "only 1 of the required 2 nodes joined" in d.reason and "--nnodes" in d.reason


def test_lost_member_gives_next_round_with_survivors_in_order_after_settling():
    v = view_of(A, C, round_=R1, changed_at=5.0)
    d = decide_round(5.05, v, CFG)
    assert d.action is Action.WAIT and d.wake_at == 5.1
    d = decide_round(5.1, v, CFG)
    assert d.action is Action.WRITE_ROUND
    assert d.round.round == 2 and d.round.node_ids == ["a", "c"]
    assert d.round.restart_count == 0 and "lost b" in d.reason


def test_loss_of_rank_zero_promotes_the_next_survivor():
    v = view_of(B, C, round_=R1, changed_at=0.0)
    d = decide_round(1.0, v, CFG)
    assert d.round.node_ids == ["b", "c"]


def test_round_members_carry_what_peers_need_without_the_node_records():
    # Only the decider reads node records; the others monitor and revoke from the round alone.
    a, b, c = (replace(n, agent_addr=f"10.0.0.{i}:7000", lease=40 + i) for i, n in enumerate((A, B, C)))
    d = decide_round(0.0, view_of(a, b, c), CFG)
    assert [(m.agent_addr, m.lease) for m in d.round.members] == [(f"10.0.0.{i}:7000", 40 + i) for i in range(3)]
    d = decide_round(1.0, view_of(b, c, round_=d.round, changed_at=0.0), CFG)
    assert [(m.node_id, m.agent_addr, m.lease) for m in d.round.members] == [("b", "10.0.0.1:7000", 41),
                                                                          ("c", "10.0.0.2:7000", 42)]


def test_member_back_with_new_incarnation_counts_as_lost_and_rejoins_as_newcomer():
    b2 = node("b", 9, inc="i1")
    v = view_of(A, b2, C, round_=R1, changed_at=0.0)
    d = decide_round(1.0, v, CFG)
    assert d.action is Action.WRITE_ROUND
    # b's old incarnation is lost; the new one is a ready newcomer and there is room again.
    assert d.round.node_ids == ["a", "c", "b"]
    assert d.round.members[2].incarnation == "i1"
    assert d.round.faults == R1.faults + 1  # agents rely on it: no fault counted, no member dropped


def test_spare_replaces_a_lost_member_at_once():
    v = view_of(A, B, D, round_=R1, changed_at=0.0)
    d = decide_round(1.0, v, CFG)
    assert d.round.node_ids == ["a", "b", "d"]


def test_worker_failure_restarts_same_members_and_counts_against_budget():
    v = view_of(A, B, C, round_=R1, requests={"b": RestartRequest("b", 1, "failure", "exit 1")})
    d = decide_round(1.0, v, CFG)
    assert d.action is Action.WRITE_ROUND
    assert d.round.node_ids == ["a", "b", "c"] and d.round.restart_count == 1


def test_failure_alongside_a_lost_member_costs_no_restart():
    v = view_of(A, C, round_=R1, requests={"a": RestartRequest("a", 1, "failure", "peer closed")})
    d = decide_round(1.0, v, CFG)
    assert d.round.restart_count == 0 and d.round.node_ids == ["a", "c"]


def test_restart_budget_spent_fails_the_job():
    r = replace(R1, restart_count=2)
    v = view_of(A, B, C, round_=r, requests={"c": RestartRequest("c", 1, "hang", "no heartbeat")})
    d = decide_round(1.0, v, CFG)
    assert d.action is Action.FAIL and "restart budget of 2" in d.reason


def test_a_failure_no_restart_can_mend_fails_the_job_at_once_with_the_workers_reason():
    v = view_of(A, B, C, round_=R1, requests={
        "a": RestartRequest("a", 1, "failure", "exit 1"),
        "b": RestartRequest("b", 1, "unfixable", "rank 3 exited with code 1: SyntaxError: invalid syntax")})
    d = decide_round(1.0, v, CFG)  # a whole budget left, and no settling wait
    assert d.action is Action.FAIL
    assert "on b in a way no restart can mend (rank 3 exited with code 1: SyntaxError: invalid syntax)" in d.reason
    stale = view_of(A, B, C, round_=replace(R1, round=2), requests={"b": RestartRequest("b", 1, "unfixable", "x")})
    assert decide_round(1.0, stale, CFG).action is Action.NONE


def test_stale_request_from_an_older_round_is_ignored():
    r2 = replace(R1, round=2)
    v = view_of(A, B, C, round_=r2, requests={"b": RestartRequest("b", 1)})
    assert decide_round(1.0, v, CFG).action is Action.NONE


def test_below_min_after_loss_writes_an_inactive_round_then_recovers_when_a_node_joins():
    r = RoundRecord(round=3, members=(member(A), member(B)))
    v = view_of(A, round_=r, changed_at=0.0)
    d = decide_round(1.0, v, CFG)
    assert d.action is Action.WRITE_ROUND and not d.round.active
    assert "waiting" in d.reason
    inactive = d.round
    v = view_of(A, round_=inactive, waiting_since=1.0)
    assert decide_round(2.0, v, CFG).action is Action.WAIT
    v = view_of(A, D, round_=inactive, waiting_since=1.0, changed_at=2.0)
    v.ready_since["d"] = 2.0
    assert decide_round(2.1, v, CFG).action is Action.WAIT  # join settle
    d = decide_round(2.3, v, CFG)
    assert d.action is Action.WRITE_ROUND and d.round.active
    assert d.round.node_ids == ["a", "d"] and d.round.round == 5


def test_newcomer_is_admitted_after_join_settle_when_below_max():
    r = RoundRecord(round=4, members=(member(A), member(B)))
    v = view_of(A, B, D, round_=r)
    v.ready_since["d"] = 10.0
    wide = replace(CFG, max_nodes=4)
    assert decide_round(10.2, v, wide).action is Action.WAIT
    d = decide_round(10.3, v, wide)
    assert d.action is Action.WRITE_ROUND and d.round.node_ids == ["a", "b", "d"]
    assert "admitted d" in d.reason


def test_newcomer_filling_the_world_to_max_is_admitted_without_waiting():
    r = RoundRecord(round=4, members=(member(A), member(B)))
    v = view_of(A, B, D, round_=r)
    v.ready_since["d"] = 10.0
    d = decide_round(10.0, v, CFG)
    assert d.action is Action.WRITE_ROUND and d.round.node_ids == ["a", "b", "d"]


def test_newcomer_waits_as_spare_when_at_max():
    v = view_of(A, B, C, D, round_=R1)
    assert decide_round(100.0, v, CFG).action is Action.NONE


def test_all_members_done_means_success_and_done_nodes_are_not_eligible():
    done = [replace(n, done_round=1) for n in (A, B, C)]
    v = view_of(*done, round_=R1)
    assert decide_round(0.0, v, CFG).action is Action.SUCCEED
    # A finished node is not picked again after another member fails.
    v = view_of(replace(A, done_round=1), B, C, round_=R1,
                requests={"b": RestartRequest("b", 1)})
    d = decide_round(1.0, v, CFG)
    assert d.round.node_ids == ["b", "c"]


def test_terminal_job_state_stops_decisions():
    v = view_of(A, B, round_=R1, job=JobState("failed", "boom"))
    assert decide_round(0.0, v, CFG).action is Action.NONE


def test_faults_are_counted_across_rounds_but_joins_are_not():
    r = replace(R1, faults=2, job_started=100.0)
    lost = decide_round(1.0, view_of(A, C, round_=r, changed_at=0.0), CFG).round
    assert lost.faults == 3 and lost.job_started == 100.0
    failed = decide_round(1.0, view_of(A, B, C, round_=r, requests={"b": RestartRequest("b", 1)}), CFG).round
    assert failed.faults == 3
    joined = decide_round(5.0, view_of(A, B, D, round_=replace(r, members=(member(A), member(B)))), CFG).round
    assert "admitted d" in joined.reason and joined.faults == 2 and joined.job_started == 100.0


def test_a_member_lost_while_the_job_waits_counts_as_a_fault_when_the_job_resumes():
    waiting = RoundRecord(2, (member(A), member(B)), active=False, faults=1)
    cfg = replace(CFG, min_nodes=2)
    back = decide_round(5.0, view_of(A, C, round_=waiting, changed_at=0.0), cfg)
    assert back.action is Action.WRITE_ROUND and back.round.active
    assert back.round.faults == 2  # b was dropped: not a pure join, whatever the agents saw before
    kept = decide_round(5.0, view_of(A, B, C, round_=waiting, changed_at=0.0), cfg)
    assert kept.round.faults == 1


def test_a_draining_member_gets_a_round_without_it_as_a_planned_change():
    v = view_of(A, replace(B, leaving=True), C, round_=replace(R1, faults=2, restart_count=1), changed_at=5.0)
    assert decide_round(5.05, v, CFG).action is Action.WAIT  # settles like any change
    d = decide_round(5.1, v, CFG)
    assert d.action is Action.WRITE_ROUND and d.round.active
    assert d.round.node_ids == ["a", "c"] and "drained b" in d.reason
    assert d.round.faults == 2 and d.round.restart_count == 1  # no fault, no restart counted
    assert d.round.planned_since == 1  # round 1's workers may commit the step they end it at
    chained = decide_round(9.0, view_of(A, replace(C, leaving=True), round_=d.round, changed_at=0.0), CFG).round
    assert chained.node_ids == ["a"] and chained.planned_since == 1  # back-to-back drains: one run


def test_a_spare_takes_a_drained_member_s_place_and_a_draining_node_is_never_admitted():
    r = RoundRecord(round=1, members=(member(A), member(B), member(C)))
    v = view_of(A, B, replace(C, leaving=True), D, round_=r, changed_at=0.0)
    d = decide_round(1.0, v, CFG)
    assert d.round.node_ids == ["a", "b", "d"]
    # a draining newcomer is not a candidate, neither for a join nor for a first round
    r2 = RoundRecord(round=2, members=(member(A), member(B)))
    assert decide_round(9.0, view_of(A, B, replace(D, leaving=True), round_=r2), CFG).action is Action.NONE
    assert decide_round(9.0, view_of(A, replace(B, leaving=True), waiting_since=0.0), CFG).action is Action.WAIT


def test_a_drain_below_min_writes_an_inactive_round_that_says_so_and_waits_for_a_newcomer():
    r = RoundRecord(round=3, members=(member(A), member(B)))
    d = decide_round(1.0, view_of(A, replace(B, leaving=True), round_=r, changed_at=0.0), CFG)
    assert d.action is Action.WRITE_ROUND and not d.round.active and d.round.faults == 0
    assert "drained b" in d.reason and "1 of at least 2 nodes left, waiting for a newcomer" in d.reason
    # the drained node, still registered while it leaves, does not count towards the minimum
    v = view_of(A, replace(B, leaving=True), round_=d.round, waiting_since=1.0)
    assert decide_round(2.0, v, CFG).action is Action.WAIT
    v = view_of(A, D, round_=d.round, waiting_since=1.0, changed_at=2.0)
    d = decide_round(2.5, v, CFG)
    assert d.action is Action.WRITE_ROUND and d.round.active and d.round.node_ids == ["a", "d"]
    assert d.round.faults == 0  # the drained member's leaving was no fault


def test_a_loss_during_a_drain_counts_one_fault_and_drops_both():
    v = view_of(A, replace(B, leaving=True), round_=R1, changed_at=0.0)  # c lost, b draining
    d = decide_round(1.0, v, CFG)
    assert d.round.node_ids == ["a"] and d.round.faults == 1 and "lost c" in d.reason
    assert d.round.planned_since == 0  # after a fault, the old round's workers commit nothing more
