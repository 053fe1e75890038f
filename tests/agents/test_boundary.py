"""Ending a round at a step boundary: which changes are planned, how long to wait, the file (pure)."""

from __future__ import annotations

from ftrt.agents.workers.boundary import (BOUNDARY_WAIT_MAX, BOUNDARY_WAIT_MIN, DEFERRED_WAIT_MAX, UNKNOWN_STEP_S,
                                         Deferral, boundary_deadline, boundary_timeout, planned_change)
from ftrt.roundendfile import RoundEndReader, RoundEndWriter
from ftrt.records import Member, RoundRecord

A, B, C = Member("a", "a1", 1), Member("b", "b1", 1), Member("c", "c1", 1)


def test_a_join_or_a_drain_is_planned_and_a_fault_or_a_new_incarnation_is_not():
    old = RoundRecord(3, (A, B), faults=1)
    assert planned_change(old, RoundRecord(4, (A, B, C), faults=1))  # c joined
    assert planned_change(old, RoundRecord(4, (A,), faults=1))  # b drained
    assert planned_change(old, RoundRecord(4, (A,), active=False, faults=1))  # b drained below the minimum
    assert not planned_change(old, RoundRecord(4, (A, B), faults=2))  # a worker failed
    assert not planned_change(old, RoundRecord(4, (A,), faults=2))  # b was lost
    # b back with a new incarnation is a lost member: the decider counts a fault for it
    # (test_decide), so the fault count alone tells an agent, which sees only its own group.
    assert not planned_change(old, RoundRecord(4, (A, Member("b", "b2", 1), C), faults=2))


def test_the_wait_covers_a_few_steps_within_bounds():
    assert boundary_timeout(0.5) == 2.5
    assert boundary_timeout(0.01) == BOUNDARY_WAIT_MIN
    assert boundary_timeout(100.0) == BOUNDARY_WAIT_MAX
    assert boundary_timeout(None) == 10.0


def test_a_worker_that_ends_at_a_later_step_gets_those_steps_from_when_it_said_so():
    asked = 100.0
    assert boundary_deadline(asked, 0.5, []) == asked + 2.5  # no deferral: the plain wait
    # asked at 100, said at 101 (step 5) that it ends after step 8: 3 steps of 0.5 s more, from 101
    assert boundary_deadline(asked, 0.5, [Deferral(3, 101.0, 5, 8)]) == 101.0 + 2.5 + 1.5
    # the latest of several workers' ends counts; one at or behind its step adds nothing
    both = [Deferral(3, 101.0, 5, 8), Deferral(3, 101.2, 5, 12), Deferral(3, 101.0, 9, 8)]
    assert boundary_deadline(asked, 0.5, both) == 101.2 + 2.5 + 3.5
    # no step time known yet: UNKNOWN_STEP_S a step; never past DEFERRED_WAIT_MAX after asking
    assert boundary_deadline(asked, None, [Deferral(3, 100.0, 0, 2)]) == 100.0 + 10.0 + 2 * UNKNOWN_STEP_S
    assert boundary_deadline(asked, 30.0, [Deferral(3, 100.0, 0, 1000)]) == asked + DEFERRED_WAIT_MAX


def test_workers_see_the_request_for_their_round_only(tmp_path):
    writer = RoundEndWriter(str(tmp_path / "round_end"))
    reader = RoundEndReader(writer.path)
    try:
        assert not reader.ending(3)
        writer.request(3)
        assert reader.ending(3) and reader.ending(2)
        assert not reader.ending(4)  # the next round's workers start fresh
        assert not reader.ending(0)  # outside a round
    finally:
        writer.close()


def test_a_durable_request_and_the_draining_flag_reach_the_workers(tmp_path):
    writer = RoundEndWriter(str(tmp_path / "round_end"))
    reader = RoundEndReader(writer.path)
    try:
        writer.request(3)
        assert reader.ending(3) and not reader.durable(3) and not reader.draining()
        writer.drain()
        writer.request(4, durable=True)  # the next round is inactive: save to storage
        assert reader.ending(4) and reader.durable(4) and reader.draining()
        assert not reader.durable(5)
    finally:
        writer.close()
