"""The round's storage layout (ftrt.roster): a header with group sizes, members in group shards,
and an agent's questions answered from the groups it read."""

from __future__ import annotations

import pytest

from ftrt.jobkeys import JobKeys
from ftrt.records import Member, RoundHeader, RoundRecord, decode
from ftrt.roster import (
    MAX_GROUPS, LocalRound, NotLoaded, decode_shard, encode_shard, group_of, groups_for, plan_write, wanted_groups,
)
from ftrt.store.api import Delete, Put

KEYS = JobKeys("j")


def members(n: int, start: int = 0) -> tuple[Member, ...]:
    return tuple(Member(f"n{i}", f"i{i}", 1 + i % 3, agent_addr=f"10.0.0.{i}:7000", lease=100 + i)
                 for i in range(start, start + n))


def ring(ids: list[str], me: str, k: int) -> list[str]:
    i = ids.index(me)
    return [ids[(i + s) % len(ids)] for s in range(1, min(k, len(ids) - 1) + 1)]


def test_group_count_follows_the_job_size_within_etcds_transaction_limit():
    assert groups_for(1) == groups_for(64) == 1  # small jobs: one group, the order decide_round chose
    assert groups_for(65) == 2 and groups_for(4096) == MAX_GROUPS
    assert 3 + 2 * MAX_GROUPS <= 128  # header + a put and a delete per group + requests/masters
    assert group_of("node-a", 7) == group_of("node-a", 7) and all(group_of(f"x{i}", 1) == 0 for i in range(9))


def test_a_shard_round_trips_with_what_peers_need():
    ms = members(3)
    got = decode_shard(encode_shard(ms))
    assert [(m.node_id, m.incarnation, m.nproc, m.agent_addr, m.lease) for m in got] == \
        [(m.node_id, m.incarnation, m.nproc, m.agent_addr, m.lease) for m in ms]


@pytest.mark.parametrize("groups", [1, 5])
def test_ranks_and_successors_from_groups_agree_with_the_whole_round(groups):
    plan = plan_write(RoundRecord(4, members(40)), groups, None, KEYS)
    whole = plan.record
    ids = whole.node_ids
    if groups == 1:
        assert ids == [f"n{i}" for i in range(40)]  # one group keeps decide_round's order
    local = LocalRound(plan.header, b"", plan.shards)
    assert local.world_size == whole.world_size and local.node_count == 40 and local.first == ids[0]
    for m in whole.members:
        assert local.rank_offset(m.node_id) == whole.rank_offset(m.node_id)
        assert local.group_rank(m.node_id) == whole.group_rank(m.node_id)
        assert [s.node_id for s in local.successors(m.node_id, 3)] == ring(ids, m.node_id, 3)
    assert local.member("stranger") is None and local.group_rank("stranger") == -1
    ranks = sorted(local.rank_offset(m.node_id) + r for m in whole.members for r in range(m.nproc))
    assert ranks == list(range(whole.world_size))  # every rank given exactly once


def test_an_agent_reads_its_group_then_its_successors_groups_only():
    plan = plan_write(RoundRecord(2, members(40)), 5, None, KEYS)
    header, shards = plan.header, plan.shards
    last_of_group = {g: ms[-1].node_id for g, ms in shards.items()}
    g0 = next(iter(shards))
    first = shards[g0][0].node_id
    assert wanted_groups(header, {}, first, 2, False) == {g0}
    assert wanted_groups(header, {g0: shards[g0]}, first, 2, False) == set()  # successors in its own group
    tail = last_of_group[g0]
    need = wanted_groups(header, {g0: shards[g0]}, tail, 2, False)
    assert len(need) == 1 and need != {g0}
    partial = LocalRound(header, b"", {g0: shards[g0]})
    with pytest.raises(NotLoaded):
        partial.successors(tail, 2)
    with pytest.raises(NotLoaded):
        _ = partial.members
    assert not partial.complete and partial.member(first) is not None
    assert wanted_groups(header, {}, "not-a-member-id", 2, False) <= {group_of("not-a-member-id", 5)}
    assert wanted_groups(header, {}, first, 2, True) == set(shards)


def test_a_loss_rewrites_one_group_and_deletes_its_old_shard():
    ms = members(40)
    first = plan_write(RoundRecord(1, ms), 5, None, KEYS)
    prev = LocalRound(first.header, b"", first.shards)
    victim = ms[17]
    g = group_of(victim.node_id, 5)
    second = plan_write(RoundRecord(2, tuple(m for m in ms if m != victim), faults=1), 5, prev, KEYS)
    puts = [op.key for op in second.ops if isinstance(op, Put)]
    deletes = [op.key for op in second.ops if isinstance(op, Delete)]
    assert puts == [KEYS.round, KEYS.roster_shard(g, 2)] and deletes == [KEYS.roster_shard(g, 1)]
    header = decode(RoundHeader, second.ops[0].value)
    assert [ref.shard for ref in header.groups] == [2 if i == g else 1 for i in range(5)]
    assert header.node_count == 39 and header.faults == 1
    # a member's new lease (it rejoined) is a change too, though Member equality ignores leases
    moved = tuple(Member(m.node_id, m.incarnation, m.nproc, agent_addr=m.agent_addr, lease=m.lease + (m == ms[3]))
                  for m in ms)
    third = plan_write(RoundRecord(2, moved), 5, prev, KEYS)
    assert [op.key for op in third.ops if isinstance(op, Put)][1:] == [KEYS.roster_shard(group_of("n3", 5), 2)]


def test_another_group_count_rewrites_everything_and_drops_the_old_shards():
    ms = members(20)
    old = plan_write(RoundRecord(1, ms), 3, None, KEYS)
    new = plan_write(RoundRecord(2, ms), 4, LocalRound(old.header, b"", old.shards), KEYS)
    deletes = {op.key for op in new.ops if isinstance(op, Delete)}
    assert deletes == {KEYS.roster_shard(g, 1) for g in old.shards}
    assert len(new.ops) <= 128


def test_an_empty_group_has_no_shard():
    plan = plan_write(RoundRecord(1, members(2)), 8, None, KEYS)
    empty = [g for g, ref in enumerate(plan.header.groups) if ref.count == 0]
    assert empty and all(plan.header.groups[g].shard == 0 for g in empty)
    assert len([op for op in plan.ops if isinstance(op, Put)]) == 1 + len(plan.shards)
