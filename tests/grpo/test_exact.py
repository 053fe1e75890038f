"""GRPO under the launcher: a killed worker resumes bit-identically; a lost node loses no prompt;
a joining node redoes nothing. Each with ``--recovery in-place`` (the default: the surviving
workers keep their processes, which rank 0's metrics lines show by their pid) and ``restart``.

Real agents on a real etcd, real worker processes, real SIGKILLs. The reference is the same
config run without faults (2 ranks); the prompt ledger is read from rank 0's metrics lines.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from ftrt.chaos.local import worker_pids
from tests.agents.harness import FAST_WARM, Node, lose_node_b, wait_until
from tests.agents.test_claims import forge_replica_in_job

pytestmark = pytest.mark.slow

STEPS, PROMPTS = 40, 6  # enough steps after the kill at step 7 that it lands mid-run
CONFIG = [f"steps={STEPS}", f"prompts_per_step={PROMPTS}", "group_size=4", "model.d_model=32",
          "model.n_layers=1", "model.n_heads=2", "checkpoint.interval=5", "checkpoint.memory_interval=1",
          "progress=none"]
EXACT = ("step", "reward_mean", "loss", "kl", "grad_norm", "world_size", "prompt_ids")


def lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


RECOVERY = pytest.mark.parametrize("recovery", ["in-place", "restart"])


def job(tmp: Path, name: str, etcd: str, job_id: str, nnodes: str, nproc: int, first_round_wait: float = 2,
        recovery: str = "in-place") -> list[str]:
    """``first_round_wait``: a long one makes the first round wait for ``nnodes``' maximum (it starts
    as soon as that many nodes are ready)."""
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--lease-ttl", "2", "--first-round-wait", str(first_round_wait), "--recovery", recovery, *FAST_WARM,
            "-m", "ftrt.grpo", *CONFIG,
            f"metrics_path={tmp / name}.jsonl", f"checkpoint.url={tmp / name}-ck"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    tmp = tmp_path_factory.mktemp("grpo-ref")
    node = Node(tmp, "ref", job(tmp, "ref", etcd_server.endpoint, "grpo-ref", "1", 2)).start()
    try:
        assert node.wait(180) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    return lines(tmp / "ref.jsonl")


def kept_in_place(run: list[dict], log: str, before: set[int] | None = None) -> None:
    """The ranks went on in place (nothing restored) in processes that ran before the fault
    (``before``; default: rank 0's process trained every step)."""
    pids = {x["pid"] for x in run}
    assert pids <= before if before is not None else len(pids) == 1, (before, sorted({(x["pid"], x["step"]) for x in run}))
    assert run[-1]["resumes"] == 0 and run[-1]["redone"] == 0, run[-1]
    assert "kept in place at step" in log and "resumed at step" not in log, log[-3000:]


def join_after_6_steps(tmp: Path, args: list[str], running: dict[str, dict[str, str]], joiner: str,
                       steps: int) -> tuple[dict[str, Node], list[dict]]:
    """Nodes ``running`` (name -> extra environment) run the job ``args``; after 6 steps ``joiner``
    starts and joins. Once every node exited 0: the nodes and the metrics lines, which must hold
    every step and every prompt once."""
    nodes = {name: Node(tmp, name, args, env=env).start() for name, env in running.items()}
    try:
        wait_until(lambda: len(lines(tmp / "run.jsonl")) >= 6, 120, "6 steps before the join")
        nodes[joiner] = Node(tmp, joiner, args).start()
        for n in nodes.values():
            assert n.wait(300) == 0, n.log()[-3000:]
    finally:
        for n in nodes.values():
            n.cleanup()
    run = lines(tmp / "run.jsonl")
    assert [x["step"] for x in run] == list(range(steps)), "a step was skipped or repeated"
    ledger = [i for x in run for i in x["prompt_ids"]]
    assert ledger == list(range(steps * PROMPTS)), "a prompt was lost or repeated"
    return nodes, run


@RECOVERY
def test_a_killed_worker_resumes_with_bit_identical_metrics_and_prompts(tmp_path, reference, etcd_endpoint, job_id,
                                                                        recovery):
    node = Node(tmp_path, "a", job(tmp_path, "run", etcd_endpoint, job_id, "1", 2, recovery=recovery)).start()
    try:
        wait_until(lambda: len(lines(tmp_path / "run.jsonl")) >= 7, 120, "step 7")
        pid = worker_pids(etcd_endpoint, job_id)[1]
        os.kill(pid, signal.SIGKILL)
        assert node.wait(180) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    run = lines(tmp_path / "run.jsonl")
    assert [x["step"] for x in run] == list(range(STEPS))
    if recovery == "in-place":  # rank 1 was killed: rank 0 kept its process and gave the newcomer the state
        kept_in_place(run, node.log())
    else:
        assert run[-1]["resumes"] == 1 and run[-1]["redone"] <= 1, run[-1]
        assert "resumed at step" in node.log() and "from memory" in node.log()
        assert len({x["pid"] for x in run}) == 2
    for mine, ref in zip(run, reference):
        assert {k: mine[k] for k in EXACT} == {k: ref[k] for k in EXACT}, mine["step"]


@RECOVERY
def test_a_lost_node_shrinks_the_world_and_trains_exactly_the_same_prompts(tmp_path, reference, etcd_endpoint, job_id,
                                                                           recovery):
    args = job(tmp_path, "run", etcd_endpoint, job_id, "1:2", 1, first_round_wait=120,  # both in round 1
               recovery=recovery)
    forged = []

    def ready() -> bool:
        """6 steps at world size 2; then, before b is killed, attack 2 of issue 32 with the job's token:
        b's own memory checkpoint, its step raised by 100000 and zeroed, pushed to a as b's replica."""
        if sum(x["world_size"] == 2 for x in lines(tmp_path / "run.jsonl")) < 6:
            return False
        forged.append(forge_replica_in_job(etcd_endpoint, job_id, victim="b", holder="a"))
        return True

    nodes, before = lose_node_b(tmp_path, args, etcd_endpoint, job_id, ready, "6 steps at world size 2")
    code, why, rank = forged[0]
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not step 1000" in why, forged
    assert f"refused a memory replica said to be node b's rank {rank}" in nodes["a"].log()
    run = lines(tmp_path / "run.jsonl")
    assert [x["step"] for x in run] == list(range(STEPS)), "a step was skipped or repeated"
    assert [x["prompt_ids"] for x in run] == [x["prompt_ids"] for x in reference]
    ledger = [i for x in run for i in x["prompt_ids"]]
    assert sorted(ledger) == list(range(STEPS * PROMPTS)) and len(set(ledger)) == len(ledger)
    worlds = [x["world_size"] for x in run]
    assert 2 in worlds and worlds[-1] == 1 and worlds == sorted(worlds, reverse=True), worlds
    if recovery == "in-place":  # b may have held rank 0: a's worker then went on as rank 0
        kept_in_place(run, nodes["a"].log(), before)


@RECOVERY
def test_a_joining_node_ends_the_round_at_a_step_boundary_and_nothing_is_redone(tmp_path, etcd_endpoint, job_id,
                                                                                recovery):
    # Long enough for a new node to warm up and join; no checkpoint at all on the cadence, so only
    # the save the round ends with can spare a redo.
    steps = 400
    swap = {f"steps={STEPS}": f"steps={steps}", "checkpoint.interval=5": "checkpoint.interval=1000",
            "checkpoint.memory_interval=1": "checkpoint.memory_interval=1000"}
    args = [swap.get(a, a) for a in job(tmp_path, "run", etcd_endpoint, job_id, "1:2", 1, recovery=recovery)]
    # a trains no further than step 10 until b's join changes its round: the join surely lands mid-run
    nodes, run = join_after_6_steps(tmp_path, args, {"a": {"FTRT_DIAG_HOLD": "round_change:10"}}, "b", steps)
    worlds = [x["world_size"] for x in run]
    assert worlds[0] == 1 and worlds[-1] == 2 and worlds == sorted(worlds), worlds
    log = nodes["a"].log()
    if recovery == "in-place":  # the running rank went on; the newcomer warmed up before its admission
        kept_in_place(run, log)
        assert "ended at a step boundary" not in log, log[-3000:]
    else:
        assert run[-1]["resumes"] == 1 and run[-1]["redone"] == 0, run[-1]
        assert "ended at a step boundary" in log and "from memory" in log, log[-3000:]


def test_a_crash_between_two_optimizer_steps_of_a_step_goes_back_to_the_memory_checkpoint_in_place(
        tmp_path, etcd_endpoint, job_id):
    """ppo_epochs=2: rank 1 dies right after the step's first optimizer step (a fault put there), so
    rank 0, kept in place, has applied half of the step and holds no whole step's state. No rank
    can give the state: the ranks restore the memory checkpoint in place, and the run is
    bit-identical to a fault-free one."""
    two = [*CONFIG, "ppo_epochs=2"]

    def args(name: str) -> list[str]:
        return [a for a in job(tmp_path, name, etcd_endpoint, f"{job_id}-{name}", "1", 2) if a not in CONFIG] + two

    ref = Node(tmp_path, "ref", args("ref")).start()
    try:
        assert ref.wait(180) == 0, ref.log()[-3000:]
    finally:
        ref.cleanup()
    marker = tmp_path / "crashed"
    node = Node(tmp_path, "a", args("run"), env={"FTRT_DIAG_CRASH": f"half_applied:8:1:{marker}"}).start()
    try:
        assert node.wait(180) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert marker.exists(), "the fault did not fire"
    run, reference = lines(tmp_path / "run.jsonl"), lines(tmp_path / "ref.jsonl")
    assert [x["step"] for x in run] == list(range(STEPS))
    assert len({x["pid"] for x in run}) == 1, "rank 0 did not keep its process"
    assert run[-1]["resumes"] == 1, run[-1]
    assert "resumed at step 8" in node.log() and "from memory" in node.log(), node.log()[-3000:]
    for mine, want in zip(run, reference):
        assert {k: mine[k] for k in EXACT} == {k: want[k] for k in EXACT}, mine["step"]


def test_a_worker_lost_in_the_gradient_all_reduce_leaves_its_peer_s_gradients_for_the_step_again(
        tmp_path, reference, etcd_endpoint, job_id):
    """Rank 1 dies right before step 8's gradient all-reduce (a fault put there), while rank 0 has
    computed its gradient and waits in that all-reduce. Rank 0, kept in place, keeps its gradient:
    in the next round it only samples and trains nothing again, the replacement rank 1 computes its
    share, and the run is bit-identical to a fault-free one."""
    marker = tmp_path / "crashed"
    node = Node(tmp_path, "a", job(tmp_path, "run", etcd_endpoint, job_id, "1", 2),
                env={"FTRT_DIAG_CRASH": f"grad_reduce:8:1:{marker}"}).start()
    try:
        assert node.wait(180) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert marker.exists(), "the fault did not fire"
    run = lines(tmp_path / "run.jsonl")
    assert [x["step"] for x in run] == list(range(STEPS))
    kept_in_place(run, node.log())
    assert run[8]["salvaged_prompts"] == PROMPTS // 2 and run[8]["salvaged_s"] > 0, run[8]
    assert "step 8 is trained again on the gradients of 3 of its 6 prompts" in node.log(), node.log()[-3000:]
    for mine, ref in zip(run, reference):
        assert {k: mine[k] for k in EXACT} == {k: ref[k] for k in EXACT}, mine["step"]


def test_a_node_lost_in_the_gradient_all_reduce_leaves_the_survivor_s_gradients_for_the_step_at_the_new_size(
        tmp_path, reference, etcd_endpoint, job_id):
    """b's worker holds right before step 10's gradient all-reduce (while a's has computed its
    gradient and waits in it), then b is SIGKILLed. a goes on alone in place: it trains step 10
    again on its kept gradient plus b's prompts, and the step's summed gradient is the fault-free
    one up to float summation order."""
    trace = tmp_path / "b-trace.jsonl"
    args = job(tmp_path, "run", etcd_endpoint, job_id, "1:2", 1, first_round_wait=120)

    def held() -> bool:
        return trace.exists() and '"held"' in trace.read_text()

    nodes, before = lose_node_b(tmp_path, args, etcd_endpoint, job_id, held, "b's worker to hold at step 10",
                                env_b={"FTRT_DIAG_HOLD": "grad_reduce:10", "FTRT_DIAG_TRACE": str(trace)})
    run = lines(tmp_path / "run.jsonl")
    assert [x["step"] for x in run] == list(range(STEPS)), "a step was skipped or repeated"
    assert [x["prompt_ids"] for x in run] == [x["prompt_ids"] for x in reference]
    assert [x["world_size"] for x in run] == [2] * 10 + [1] * (STEPS - 10)
    kept_in_place(run, nodes["a"].log(), before)
    assert run[10]["salvaged_prompts"] == PROMPTS // 2, run[10]
    for mine, ref in zip(run[:10], reference):
        assert {k: mine[k] for k in EXACT} == {k: ref[k] for k in EXACT}, mine["step"]
    # the step's summed gradient is the fault-free one (its norm, up to float summation order)
    assert run[10]["grad_norm"] == pytest.approx(reference[10]["grad_norm"], rel=1e-5), (run[10], reference[10])

def test_a_node_that_joins_while_a_step_s_gradients_are_out_loses_and_repeats_nothing(tmp_path, etcd_endpoint, job_id):
    """a and b train at world size 2; a holds right before step 10's gradient all-reduce until the
    round changes (b waits in that all-reduce meanwhile), and c joins then. The join's round adds a
    rank and loses none, so the step in flight is finished at world size 2, with the ranks agreeing
    in its sums to take the join after it; step 11 is the first at world size 3. Every step and
    prompt is trained once, none is trained again and no worker restarts."""
    args = job(tmp_path, "run", etcd_endpoint, job_id, "2:3", 1)
    nodes, run = join_after_6_steps(tmp_path, args, {"a": {"FTRT_DIAG_HOLD": "grad_reduce:10"}, "b": {}}, "c", STEPS)
    worlds = [x["world_size"] for x in run]
    assert worlds[:11] == [2] * 11 and worlds[-1] == 3 and worlds == sorted(worlds), worlds
    assert run[-1]["redone"] == 0 and run[-1]["resumes"] == 0, run[-1]
    assert not any("salvaged_prompts" in x for x in run), [x["step"] for x in run if "salvaged_prompts" in x]
    log = nodes["a"].log() + nodes["b"].log()
    assert "kept in place at step 11" in log and "resumed at step" not in log, log[-3000:]
    assert "during a step" not in log, log[-3000:]  # no collective of the old round was left
