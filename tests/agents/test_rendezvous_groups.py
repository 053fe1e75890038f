"""A job big enough for several member groups (ftrt.roster), on a real etcd: every node gets its
ranks and its ring successors from its own groups, the ranks are a permutation, and a node's loss
rewrites its group's shard only."""

from __future__ import annotations

import asyncio

from ftrt.chaos.local import until
from ftrt.agents.rendezvous.decide import RendezvousConfig
from ftrt.agents.ops.sim import SimNode
from ftrt.jobkeys import JobKeys
from ftrt.roster import group_of, groups_for, load_round
from ftrt.store.etcd import EtcdStore

N = 24
CFG = RendezvousConfig(min_nodes=1, max_nodes=200, settle_s=0.05, join_settle_s=0.2, first_round_wait_s=0.3)


async def test_grouped_rounds_give_every_rank_once_and_a_loss_rewrites_one_group(etcd_endpoint, job_id):
    groups = groups_for(CFG.max_nodes)
    assert groups > 1
    keys = JobKeys(job_id)
    nodes = {f"node{i}": SimNode(etcd_endpoint, job_id, f"node{i}", CFG) for i in range(N)}
    store = EtcdStore(etcd_endpoint)
    alive = dict(nodes)
    try:
        await asyncio.gather(*(n.join() for n in nodes.values()))

        def held(world: int) -> bool:
            return all((r := n.rdzv.view.round) is not None and r.active and r.world_size == world
                       for n in alive.values())

        await until(lambda: held(N), 20, f"{N} nodes holding their ranks")
        whole = await load_round(store, keys)
        assert whole is not None and whole.node_count == N
        ids = whole.node_ids
        assert sorted(r for n in nodes.values() for r in n.workers.ranks) == list(range(N))
        partial = 0
        for nid, node in nodes.items():
            mine = node.rdzv.view.round
            assert mine.rank_offset(nid) == whole.rank_offset(nid) == node.workers.ranks[0]
            i = ids.index(nid)
            assert [m.node_id for m in mine.successors(nid, 2)] == [ids[(i + 1) % N], ids[(i + 2) % N]]
            partial += not mine.complete
        assert partial >= N // 2  # most agents read a part of the round, not all of it

        victim = ids[N // 2]
        before = {g: ref.shard for g, ref in enumerate(whole.header.groups)}
        await alive.pop(victim).die()
        await until(lambda: held(N - 1), 20, f"{N - 1} nodes holding their ranks")
        after = await load_round(store, keys)
        changed = {g for g, ref in enumerate(after.header.groups) if ref.shard != before[g]}
        assert changed == {group_of(victim, groups)}
        assert sorted(r for n in alive.values() for r in n.workers.ranks) == list(range(N - 1))
        shards, _ = await store.get_prefix(keys.roster)
        assert len(shards) == sum(1 for ref in after.header.groups if ref.count)  # old shard deleted
        assert [m.node_id for m in after.members] == [x for x in ids if x != victim]  # order kept
    finally:
        await asyncio.gather(*(n.die() for n in alive.values()), return_exceptions=True)
        await store.close()
