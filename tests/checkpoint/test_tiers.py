"""Memory tiers under ``ftrt launch``: a node's loss is restored from peer memory, resharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.harness import FAST_WARM, Node, kill_at_rest, replica_steps, wait_until

WORKER = Path(__file__).with_name("tier_worker.py")
pytestmark = pytest.mark.slow


def events(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def test_node_loss_restores_from_peer_memory_with_at_most_one_step_lost(tmp_path, etcd_endpoint, job_id):
    log = tmp_path / "events.jsonl"
    args = ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1:2", "--lease-ttl", "2",
            "--first-round-wait", "1", *FAST_WARM, str(WORKER), str(tmp_path / "ck"), str(log), "400", str(tmp_path / "hold")]
    nodes = {n: Node(tmp_path, n, args).start() for n in ("a", "b")}
    try:
        wait_until(lambda: any(e["event"] == "step" and e["world"] == 2 and e["step"] >= 40 for e in events(log)),
                   90, "the 2-node world past step 40")
        killed_at = kill_at_rest(
            nodes["b"], nodes["a"], tmp_path / "hold", lambda: max(e["step"] for e in events(log) if e["event"] == "step"))
        last_before = max(e["step"] for e in events(log) if e["event"] == "step" and e["time"] < killed_at)
        restore = wait_until(
            lambda: next((e for e in events(log) if e["event"] == "restore" and e["world"] == 1), None),
            60, "the survivor's restore at world 1")
        assert restore["tier"] == "memory", restore
        assert restore["ok"], "restored values differ from the state saved at that step"
        assert last_before - restore["step"] <= 1, (last_before, restore)
        assert nodes["a"].wait(120) == 0, nodes["a"].log()
    finally:
        for n in nodes.values():
            n.cleanup()


def test_worker_crash_restores_from_its_own_nodes_memory(tmp_path):
    import subprocess
    import sys

    log = tmp_path / "events.jsonl"
    script = tmp_path / "crashy.py"
    # Run the tier worker, but crash rank 1 once at step 30 (an os._exit: no cleanup).
    script.write_text(
        "import os, runpy, sys, json\n"
        "import ftrt.checkpoint.checkpointer as c\n"
        "orig = c.Checkpointer.save\n"
        f"marker = {str(tmp_path / 'crashed')!r}\n"
        "def save(self, step, state, **kw):\n"
        "    h = orig(self, step, state, **kw)\n"
        "    if step == 30 and self.rank == 1 and not os.path.exists(marker):\n"
        "        h.wait_staged(); open(marker, 'w').close(); os._exit(1)\n"
        "    return h\n"
        "c.Checkpointer.save = save\n"
        f"sys.argv = ['w', {str(tmp_path / 'ck')!r}, {str(log)!r}, '60']\n"
        f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", "2",
         *FAST_WARM, str(script)], capture_output=True, text=True, timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    restores = [e for e in events(log) if e["event"] == "restore"]
    assert len(restores) == 2 and restores[1]["tier"] == "memory" and restores[1]["ok"]
    assert restores[1]["step"] >= 29


def _holders(nodes: dict, source: str) -> set[str]:
    """The nodes whose agents hold replicas from ``source``."""
    return {n for n, node in nodes.items() if n != source and replica_steps(node, source)}


def test_two_adjacent_nodes_lost_at_once_restore_from_memory_with_two_replicas(tmp_path, etcd_endpoint, job_id):
    """--replicas 2: a node's ranks are copied to its two ring successors, so a node and its
    successor lost together still leave a copy of every lost rank on a survivor (with one replica,
    the successor held the only copy of the first node's shards, and the restore came from storage)."""
    log = tmp_path / "events.jsonl"
    hold = tmp_path / "hold"
    args = ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "2:4", "--lease-ttl", "2",
            "--first-round-wait", "5", "--replicas", "2", *FAST_WARM,
            str(WORKER), str(tmp_path / "ck"), str(log), "400", str(hold)]
    nodes = {n: Node(tmp_path, n, args).start() for n in ("a", "b", "c", "d")}

    def last_step() -> int:
        return max(e["step"] for e in events(log) if e["event"] == "step")

    try:
        wait_until(lambda: any(e["event"] == "step" and e["world"] == 4 and e["step"] >= 30 for e in events(log)),
                   180, "the 4-node world past step 30")
        # Ring order from the replicas: x's two holders are its successors s1 and s2, and s2 also
        # holds s1's replicas. Lose x and s1 together.
        wait_until(lambda: len(_holders(nodes, "a")) == 2, 60, "a's replicas on two nodes")
        p, q = sorted(_holders(nodes, "a"))
        first = p if q in _holders(nodes, p) else q
        lost = ("a", first)
        survivors = [n for n in nodes if n not in lost]
        hold.touch()
        try:
            seen: list[int] = []

            def at_rest() -> bool:
                seen.append(last_step())
                if len(seen) <= 20 or seen[-1] != seen[-20]:
                    return False
                held = [s for x in lost for n in survivors for s in replica_steps(nodes[n], x)]
                return bool(held) and min(held) >= seen[-1]  # every survivor's copy of a lost node is current

            wait_until(at_rest, 60, "the job at rest with current replicas of both lost nodes", interval=0.02)
            last_before = last_step()
            for n in lost:
                nodes[n].kill()
        finally:
            hold.unlink()
        restore = wait_until(
            lambda: next((e for e in events(log) if e["event"] == "restore" and e["world"] == 2), None),
            90, "the survivors' restore at world 2")
        assert restore["tier"] == "memory", (restore, {n: nodes[n].log()[-2000:] for n in survivors})
        assert restore["ok"], "restored values differ from the state saved at that step"
        assert restore["step"] == last_before, (last_before, restore)
    finally:
        for n in nodes.values():
            n.cleanup()
