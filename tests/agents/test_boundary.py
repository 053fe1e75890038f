"""Ending a round at a step boundary: which changes are planned, how long to wait, the file (pure)."""

from __future__ import annotations

from ftrt.agents.workers.boundary import BOUNDARY_WAIT_MAX, BOUNDARY_WAIT_MIN, boundary_timeout, planned_change
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
