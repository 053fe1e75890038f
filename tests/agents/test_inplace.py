"""Survivors keep their processes: round changes in place on real etcd, agents and workers (loopback).

The workload is ``ftrt.examples.ddp_steps --in-place``: hand-written data parallelism whose every rank
logs its pid and a checksum of its weights after each step. Each test injects a fault or a join and
checks that the workers that did nothing wrong kept their pids, that no step was lost, and that every
rank of a step holds the same weights (a newcomer or a rank one step behind got them from a peer).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.agents.harness import Progress, ddp_args, wait_until

pytestmark = pytest.mark.slow


def in_place_args(progress: Progress, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ddp_args(progress.path, steps=steps, extra=("--in-place", *extra))


def pids_by_rank_and_round(progress: Progress) -> dict[tuple[int, int], set[int]]:
    out: dict[tuple[int, int], set[int]] = {}
    for x in progress.lines():
        out.setdefault((x["round"], x["rank"]), set()).add(x["pid"])
    return out


def assert_every_step_once_with_one_state(progress: Progress, steps: int) -> None:
    """Every step up to the end was trained at some world size, and in each (round, step) all ranks
    hold the same weights."""
    lines = progress.lines()
    assert sorted({x["step"] for x in lines}) == list(range(steps))
    by_step: dict[tuple[int, int], set[float]] = {}
    for x in lines:
        by_step.setdefault((x["round"], x["step"]), set()).add(x["w"])
    split = {k: v for k, v in by_step.items() if len(v) > 1}
    assert not split, f"ranks disagree on the weights at (round, step) {sorted(split)[:5]}"


def test_a_worker_crash_replaces_only_that_worker(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = in_place_args(progress, 60, ("--fail-at-step", "20", "--fail-rank", "1"))
    a = make_node("a", script, nnodes="2")
    b = make_node("b", script, nnodes="2")
    assert a.wait(90) == 0, a.log()
    assert b.wait(30) == 0, b.log()
    assert_every_step_once_with_one_state(progress, 60)
    lines = progress.lines()
    assert len({x["round"] for x in lines}) == 2
    rank0 = {x["pid"] for x in lines if x["rank"] == 0}
    rank1 = {x["pid"] for x in lines if x["rank"] == 1}
    assert len(rank0) == 1, f"rank 0 was restarted: pids {rank0}"
    assert len(rank1) == 2, f"the crashed rank 1 should have been replaced once: pids {rank1}"
    log = a.log() + b.log()
    assert "kept in place" in log and "exited with code 1" in log


@pytest.mark.parametrize("holds_rank0", [False, True], ids=["other", "rank0-store"])
def test_a_lost_node_leaves_the_survivors_running_in_their_processes(tmp_path, make_node, holds_rank0):
    """Also when the lost node held rank 0 and the round's store: the next round's store is the one
    the new first node's kept worker already serves."""
    progress = Progress(tmp_path / "p.jsonl")
    script = in_place_args(progress, 160)
    nodes = {nid: make_node(nid, script) for nid in ("n0", "n1", "n2")}
    before = wait_until(lambda: progress.stepping(world=3, ranks=3), 60, "three ranks stepping at world 3")
    assert before
    wait_until(lambda: all(n.warm() for n in nodes.values()), 30, "warm spares")
    wait_until(lambda: max(x["step"] for x in progress.lines()) >= 30, 60, "step 30")
    pids = {x["rank"]: x["pid"] for x in progress.lines() if x["world"] == 3}
    victim = next(nid for nid, n in nodes.items() if (pids[0] in n.tree()) == holds_rank0)
    [lost] = [pid for pid in pids.values() if pid in nodes[victim].tree()]
    killed_at = nodes[victim].kill()
    wait_until(lambda: progress.stepping(world=2, ranks=2, since=killed_at), 30, "both survivors stepping at world 2")
    survivors = [nid for nid in nodes if nid != victim]
    status = nodes[survivors[0]].agent_status()  # what `ftrt status` shows: the same process, since round 1
    [worker] = [w for w in status.workers if w.rank >= 0]
    assert (status.health.round, worker.since_round) == (2, 1), status
    for nid in survivors:
        assert nodes[nid].wait(90) == 0, nodes[nid].log()
    assert_every_step_once_with_one_state(progress, 160)
    after = {x["pid"] for x in progress.lines() if x["world"] == 2}
    assert after == set(pids.values()) - {lost}, f"survivors' pids changed: before {pids}, after {after}"


def join_b(tmp_path, make_node, extra: tuple[str, ...] = ()):
    """a trains alone, b joins it, both train to the end (120 steps, every one once, with one
    state); returns (a, b, progress)."""
    progress = Progress(tmp_path / "p.jsonl")
    script = in_place_args(progress, 120, extra)
    a = make_node("a", script, nnodes="1:2")
    wait_until(lambda: progress.stepping(world=1, ranks=1), 60, "a stepping alone")
    b = make_node("b", script, nnodes="1:2")
    wait_until(lambda: progress.stepping(world=2, ranks=2), 60, "both stepping at world 2")
    assert a.wait(90) == 0, a.log()
    assert b.wait(30) == 0, b.log()
    assert_every_step_once_with_one_state(progress, 120)
    return a, b, progress


def test_a_joining_node_gets_the_weights_and_the_running_rank_keeps_its_process(tmp_path, make_node):
    a, b, progress = join_b(tmp_path, make_node)
    pids = pids_by_rank_and_round(progress)
    a_pids = {x["pid"] for x in progress.lines() if x["rank"] == 0}
    assert len(a_pids) == 1, f"the running rank was restarted at the join: {pids}"
    # b's worker started before b was admitted, warmed up, and is the one that trained as rank 1.
    log = b.log()
    assert "workers warmed up before admission" in log
    early = re.search(r"started 1 worker\(s\) \(pids \[(\d+)\]\) before this node's admission", log)
    assert early, log
    b_pids = {x["pid"] for x in progress.lines() if x["rank"] == 1}
    assert b_pids == {int(early.group(1))}, f"the newcomer was restarted: {pids}"


def test_a_newcomer_that_fails_while_warming_up_is_replaced_when_admitted(tmp_path, make_node):
    """b's worker, started before b's admission, exits while it warms up: b still joins, with a
    fresh worker, and no step is lost."""
    _, b, progress = join_b(tmp_path, make_node, ("--fail-before-admission",))
    assert "exited with code 1 before it was admitted" in b.log()
    assert "did not all reach rt.init_process_group" in b.log()
    assert len({x["pid"] for x in progress.lines() if x["rank"] == 0}) == 1


def test_a_worker_that_does_not_take_its_round_is_killed_and_replaced(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    # Rank 1 crashes at step 20; rank 0, kept in place, does not take the new round (it sleeps).
    script = in_place_args(progress, 60, ("--fail-at-step", "20", "--fail-rank", "1", "--wedge-on-change", "0"))
    a = make_node("a", script, nnodes="2", extra=("--reconfigure-timeout", "2"))
    b = make_node("b", script, nnodes="2", extra=("--reconfigure-timeout", "2"))
    assert a.wait(90) == 0, a.log()
    assert b.wait(30) == 0, b.log()
    assert sorted({x["step"] for x in progress.lines()}) == list(range(60))
    log = a.log() + b.log()
    assert "did not take round 2 in place within 2 s" in log
    rank0 = [x["pid"] for x in progress.lines() if x["rank"] == 0]
    assert len(set(rank0)) == 2, "the wedged rank 0 should have been replaced"


@pytest.mark.parametrize("workload", ["plain", "ddp"])
def test_a_frozen_node_is_left_behind_in_place_and_rejoins_in_place(tmp_path, make_node, workload):
    """SIGSTOP holds a gloo collective forever; the survivors' bounded waits leave it when their
    agents hand over the round without the frozen node. Thawed, its workers stop by the fence, its
    agent rejoins, and the survivors take the join in place too."""
    progress = Progress(tmp_path / "p.jsonl")
    script = in_place_args(progress, 400)
    if workload == "ddp":  # DDP with ftrt's bounded comm hook (imports torch._dynamo: slower to start)
        script = [a for a in script if a != "--plain"]
    nodes = {nid: make_node(nid, script) for nid in ("n0", "n1", "n2")}
    wait_until(lambda: progress.stepping(world=3, ranks=3), 90, "three ranks stepping at world 3")
    wait_until(lambda: max(x["step"] for x in progress.lines()) >= 30, 60, "step 30")
    pids = {x["rank"]: x["pid"] for x in progress.lines() if x["world"] == 3}
    [frozen] = [pid for pid in pids.values() if pid in nodes["n1"].tree()]
    survivors = set(pids.values()) - {frozen}
    frozen_at = nodes["n1"].freeze()
    wait_until(lambda: progress.stepping(world=2, ranks=2, since=frozen_at), 30, "both survivors stepping at world 2")
    nodes["n1"].thaw()
    rejoined = wait_until(lambda: progress.stepping(world=3, ranks=3, since=frozen_at), 60, "three ranks again")
    assert rejoined
    after = {x["pid"] for x in progress.after(frozen_at)}
    assert survivors <= after and frozen not in after, f"before {pids}, after {after}"
    for nid in ("n0", "n2"):
        assert nodes[nid].wait(90) == 0, nodes[nid].log()
    assert_every_step_once_with_one_state(progress, 400)
    assert "restarted" not in nodes["n0"].log()


def test_a_drained_node_leaves_and_the_others_keep_their_processes(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = in_place_args(progress, 300, ("--boundary", "--ckpt-every", "10"))
    # A 10 s lease: the drain, not a lease lost on a busy machine, is what changes the world here.
    nodes = {nid: make_node(nid, script, extra=("--lease-ttl", "10", "--first-round-wait", "120"))
             for nid in ("n0", "n1", "n2")}
    wait_until(lambda: progress.stepping(world=3, ranks=3), 90, "three ranks stepping at world 3")
    wait_until(lambda: max(x["step"] for x in progress.lines()) >= 30, 60, "step 30")
    pids = {x["rank"]: x["pid"] for x in progress.lines() if x["world"] == 3}
    [leaving] = [pid for pid in pids.values() if pid in nodes["n1"].tree()]
    asked_at = time.time()
    nodes["n1"].proc.send_signal(signal.SIGTERM)
    assert nodes["n1"].wait(60) == 0, nodes["n1"].log()
    wait_until(lambda: progress.stepping(world=2, ranks=2, since=asked_at), 30, "both others stepping at world 2")
    for nid in ("n0", "n2"):
        assert nodes[nid].wait(90) == 0, nodes[nid].log()
    assert_every_step_once_with_one_state(progress, 300)
    after = {x["pid"] for x in progress.lines() if x["world"] == 2}
    assert after == set(pids.values()) - {leaving}, f"before {pids}, after {after}"
