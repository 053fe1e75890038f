"""Simulation mode (ftrt.agents.ops.sim) on a real etcd: many simulated agents agree, shrink (also when
the decider is the node lost), and the rendezvous bench's counters and process protocol work end
to end at a small size."""

from __future__ import annotations

import asyncio
import sys

import pytest

from ftrt.chaos.local import until
from ftrt.agents.rendezvous.decide import RendezvousConfig
from ftrt.agents.ops.sim import SimNode


def test_sim_nodes_agree_on_one_round_and_shrink_when_one_dies(etcd_endpoint, job_id):
    async def go():
        events: list[dict] = []
        cfg = RendezvousConfig(min_nodes=1, max_nodes=12)
        nodes = [SimNode(etcd_endpoint, job_id, f"sim{i}", cfg, emit=events.append) for i in range(12)]
        await asyncio.gather(*(n.connect() for n in nodes))
        await asyncio.gather(*(n.join() for n in nodes))

        full = lambda: [e for e in events if e["event"] == "round" and e["world"] == 12]  # noqa: E731
        await until(lambda: len(full()) == 12, 20, "12 nodes in one round")
        assert sorted(r for e in full() for r in e["ranks"]) == list(range(12))
        assert len({e["round"] for e in full()}) == 1
        await nodes[5].die()
        shrunk = lambda: [e for e in events if e["event"] == "round" and e["world"] == 11]  # noqa: E731
        await until(lambda: len(shrunk()) == 11, 20, "the round of 11")
        assert "sim5" not in {e["node"] for e in shrunk()}
        assert sorted(r for e in shrunk() for r in e["ranks"]) == list(range(11))
        # Exactly one node decides; only it holds the node records.
        deciders = [n for n in nodes if n.rdzv.deciding]
        assert len(deciders) == 1 and len(deciders[0].rdzv.view.nodes) == 11
        assert all(not n.rdzv.view.nodes for n in nodes if n is not deciders[0])
        # The decider's loss: another node takes over and writes the round without it.
        lost = deciders[0]
        await lost.die()
        assert not lost.rdzv.deciding, "a closed rendezvous still counted itself the decider"
        alive = [n for n in nodes if n is not lost and n is not nodes[5]]
        again = lambda: [e for e in events if e["event"] == "round" and e["world"] == 10]  # noqa: E731
        await until(lambda: len(again()) == 10, 20, "the round of 10")
        assert lost.node_id not in {e["node"] for e in again()}
        assert sorted(r for e in again() for r in e["ranks"]) == list(range(10))
        await until(lambda: sum(n.rdzv.deciding for n in alive) == 1, 20, "one decider")
        await asyncio.gather(*(n.die() for n in alive))

    asyncio.run(go())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rdzv_scale_bench_runs_both_systems_at_a_small_size(tmp_path):
    import json
    import subprocess

    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "bench", "rdzv_scale", "--sizes", "8", "--procs", "2", "--cap", "60", "--c10d", "best",
                          "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = {(r["system"], r["nodes"]): r for r in json.loads(out.read_text())["results"]}
    ftrt, c10d = data[("ftrt", 8)], data[("c10d best", 8)]
    assert ftrt["join_s"] and ftrt["loss_s"] and ftrt["decider_loss_s"], ftrt
    assert c10d["join_s"] and c10d["loss_s"], c10d
    # Per node a lease grant, a registration, a campaign, a read and a watch of rdzv/, and a read of
    # its member group per round it sees; a few round writes: linear in nodes.
    assert 8 * 2 <= ftrt["join_etcd"]["requests"] <= 8 * 10, ftrt["join_etcd"]
    assert "c10d best" in res.stdout and ("c10d default", 8) not in data
