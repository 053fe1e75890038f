"""The election's rules on the in-memory store, with an injected clock: who leads, who is woken when a
leader goes, how slots are shared. No etcd and no sleeping: a lease runs out when the test moves the
clock, and the event loop runs until every candidate waits (its etcd contract: tests/agents/test_election.py).
"""

from __future__ import annotations

import asyncio

import pytest

from ftrt.errors import LeaseLost
from ftrt.store.api import Put
from ftrt.store.concurrency import SLOTS, Election, slot_of
from ftrt.store.memory import MemoryStore

PREFIX = "/ftrt/j/election/"
TTL = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def settled() -> None:
    """Let every task run until it waits on the store (nothing here waits on time)."""
    for _ in range(100):
        await asyncio.sleep(0)


def distinct_slots(n: int) -> list[str]:
    ids, used = [], set()
    for i in range(1000):
        if slot_of(f"n{i}") not in used:
            used.add(slot_of(f"n{i}"))
            ids.append(f"n{i}")
        if len(ids) == n:
            return ids
    raise AssertionError("not enough distinct slots")


async def candidates(store: MemoryStore, ids: list[str]) -> tuple[list[Election], list[asyncio.Task]]:
    """One candidacy per id, each under a lease of its own, campaigning in this order."""
    elections, campaigns = [], []
    for nid in ids:
        lease = await store.grant_lease(TTL)
        elections.append(Election(store, PREFIX, nid, lease.id, nid.encode()))
        campaigns.append(asyncio.create_task(elections[-1].campaign()))
        await settled()  # joined in order: the slot keys' create revisions give the queue
    return elections, campaigns


async def test_the_first_slot_holder_leads_and_a_leader_whose_lease_ran_out_is_followed_by_its_successor():
    clock = Clock()
    store = MemoryStore(clock)
    elections, campaigns = await candidates(store, distinct_slots(4))
    try:
        assert [c.done() for c in campaigns] == [True, False, False, False]
        leader = elections[0]
        assert (await store.txn([leader.fence()], [Put("/decider", b"n0")])).succeeded
        clock.t += TTL / 2
        for e in elections[1:]:
            await store.keep_alive(e.lease_id)
        clock.t += TTL / 2 + 0.1  # the leader's lease runs out; the others' were renewed
        await store.tick()
        await asyncio.wait_for(campaigns[1], 5)
        await settled()
        assert elections[1].leader and [c.done() for c in campaigns[2:]] == [False, False]
        assert not (await store.txn([leader.fence()], [Put("/decider", b"n0")])).succeeded  # fenced out
        assert not await leader.still_leads() and await elections[1].still_leads()
    finally:
        for c in campaigns:
            c.cancel()
        await store.close()


async def test_a_candidate_leaving_the_middle_of_the_queue_makes_no_new_leader_and_resigning_passes_it_on():
    store = MemoryStore(Clock())
    elections, campaigns = await candidates(store, distinct_slots(4))
    try:
        await store.revoke_lease(elections[2].lease_id)  # one in the middle leaves
        await settled()
        assert [c.done() for c in campaigns] == [True, False, False, False]
        await elections[0].resign()  # the leader steps down
        await asyncio.wait_for(campaigns[1], 5)
        await elections[1].resign()
        await asyncio.wait_for(campaigns[3], 5)  # 2 left earlier: its successor now waited on 1
        with pytest.raises(LeaseLost):  # 2, woken too, finds its own key gone: it never leads
            await asyncio.wait_for(campaigns[2], 5)
        assert elections[3].leader and not elections[2].leader
    finally:
        for c in campaigns:
            c.cancel()
        await store.close()


async def test_at_most_slots_candidates_and_a_freed_slot_goes_to_one_of_those_waiting_for_it():
    store = MemoryStore(Clock())
    ids = [f"node-{i}" for i in range(3 * SLOTS)]
    elections, campaigns = await candidates(store, ids)
    try:
        kvs, _ = await store.get_prefix(PREFIX)
        assert len(kvs) == len({slot_of(i) for i in ids}) <= SLOTS
        assert sum(c.done() for c in campaigns) == 1
        leader = next(e for e, c in zip(elections, campaigns) if c.done())
        sharing = [e for e in elections if e.key == leader.key and e is not leader]
        assert sharing and not any(e.create_revision for e in sharing)  # waiting for the slot
        await store.revoke_lease(leader.lease_id)
        await settled()
        assert sum(bool(e.create_revision) for e in sharing) == 1  # one of them holds the slot now
        assert sum(c.done() for c in campaigns) == 2  # and someone leads again
    finally:
        for c in campaigns:
            c.cancel()
        await store.close()
