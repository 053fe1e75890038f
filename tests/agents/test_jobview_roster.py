"""A round whose member shards are damaged or gone, on a real etcd: the agent's view logs it and
waits for the next round (its watch lives on); a round key in the format of an older ftrt is
refused with a clear message; the decider decides on, counting an unreadable group's members as
newcomers."""

from __future__ import annotations

import logging

from ftrt.chaos.local import until
from ftrt.agents.rendezvous.jobview import JobView
from ftrt.jobkeys import JobKeys
from ftrt.records import Member, RoundRecord, encode
from ftrt.roster import LocalRound, group_of, plan_write
from ftrt.store.api import Put
from ftrt.store.etcd import EtcdStore

GROUPS = 3


def members(n: int) -> tuple[Member, ...]:
    return tuple(Member(f"n{i}", "inc", 1, agent_addr=f"127.0.0.1:{7000 + i}", lease=1) for i in range(n))


async def write(store: EtcdStore, keys: JobKeys, rec: RoundRecord, prev: LocalRound | None) -> LocalRound:
    plan = plan_write(rec, GROUPS, prev, keys)
    res = await store.txn([], list(plan.ops))
    assert res.succeeded
    return LocalRound(plan.header, encode(plan.header), plan.shards)


class Errors(logging.Handler):
    """The job view's error lines (attached to its logger: nothing upstream can swallow them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)


async def test_a_damaged_shard_is_refused_and_the_next_round_is_taken(etcd_endpoint, job_id):
    errors = Errors()
    logging.getLogger("ftrt.agents.rendezvous.jobview").addHandler(errors)
    keys = JobKeys(job_id)
    store = EtcdStore(etcd_endpoint)
    me = "n0"
    view = JobView(store, keys, me, successors=2, clock=lambda: 0.0, on_change=lambda: None)
    try:
        r1 = await write(store, keys, RoundRecord(1, members(12)), None)
        await view.start()
        assert view.view.round.round == 1
        # Round 2 drops a member of my group, and its new shard is garbage.
        mine = group_of(me, GROUPS)
        gone = next(m for m in members(12) if m.node_id != me and group_of(m.node_id, GROUPS) == mine)
        ms = tuple(m for m in members(12) if m != gone)
        r2 = plan_write(RoundRecord(2, ms, faults=1), GROUPS, r1, keys)
        assert any(isinstance(op, Put) and op.key == keys.roster_shard(mine, 2) for op in r2.ops)
        ops = [Put(op.key, b'{"members": [["n0", "inc"]]}') if isinstance(op, Put)
               and op.key == keys.roster_shard(mine, 2) else op for op in r2.ops]
        assert (await store.txn([], ops)).succeeded
        await until(lambda: errors.saw("damaged"), 10, "the damaged shard refused")
        assert view.view.round.round == 1  # not taken: my ranks cannot be known from it
        # An old ftrt's round record at the round key: refused, named as such.
        await store.put(keys.round, encode(RoundRecord(3, ms)))
        await until(lambda: errors.saw("without member groups"), 10, "the header without groups refused")
        assert view.view.round.round == 1
        # The watch lives on: the next good round (every group written anew) is taken.
        good = await write(store, keys, RoundRecord(4, ms, faults=1), None)
        await until(lambda: view.view.round is not None and view.view.round.round == 4, 10, "round 4 in the view")
        assert view.view.round.rank_offset(me) == good.rank_offset(me)
    finally:
        logging.getLogger("ftrt.agents.rendezvous.jobview").removeHandler(errors)
        await view.close()
        await store.close()


async def test_the_decider_decides_on_when_a_shard_of_the_current_round_is_gone(etcd_endpoint, job_id):
    keys = JobKeys(job_id)
    store = EtcdStore(etcd_endpoint)
    view = JobView(store, keys, "n0", successors=2, clock=lambda: 0.0, on_change=lambda: None)
    try:
        r1 = await write(store, keys, RoundRecord(1, members(12)), None)
        await view.start()
        lost = next(g for g in range(GROUPS) if g != group_of("n0", GROUPS) and r1.header.groups[g].count)
        await store.delete(keys.roster_shard(lost, 1))
        view._following_nodes = True  # what taking office sets: every group is needed
        assert await view.ensure_complete()
        cur = view.view.round
        assert cur.complete and cur.groups[lost] == ()
        assert {m.node_id for m in cur.members} == {m.node_id for g, ms in r1.groups.items() if g != lost for m in ms}
    finally:
        await view.close()
        await store.close()


def test_a_node_that_starts_draining_restarts_the_decider_s_settle_wait():
    from dataclasses import replace

    from ftrt.records import NodeRecord
    from ftrt.store.api import WatchEvent
    from ftrt.store.memory import MemoryStore

    now = [0.0]
    keys = JobKeys("j")
    view = JobView(MemoryStore(), keys, "a", successors=1, clock=lambda: now[0], on_change=lambda: None)
    view._following_nodes = True  # the decider follows the node records
    rec = NodeRecord(node_id="b", incarnation="i1", host="h", agent_addr="h:1", nproc=1, ready=True)
    view.apply(WatchEvent("put", keys.node("b"), encode(rec), 5, 5, 7))
    now[0] = 10.0
    view.apply(WatchEvent("put", keys.node("b"), encode(rec), 6, 5, 7))  # rewritten, nothing changed
    assert view.view.changed_at == 0.0
    view.apply(WatchEvent("put", keys.node("b"), encode(replace(rec, leaving=True)), 7, 5, 7))
    assert view.view.changed_at == 10.0  # nodes leaving together settle into one round
