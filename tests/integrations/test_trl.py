"""TRL's GRPOTrainer under ftrt (``ftrt.integrations.trl``): a real GRPOTrainer generating with a
tiny Llama, 2 ranks on gloo, real agents on a real etcd, a real SIGKILL inside a generation window;
losses compared bit for bit with the uninterrupted run. The same crash with only the Hugging Face
callback (TRL's own resume) diverges: the upstream gap, kept as an expected failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed")

from ftrt.chaos.local import worker_pids  # noqa: E402
from tests.agents.harness import FAST_WARM, Node, wait_until  # noqa: E402
from tests.integrations.kit import BOTH_IN_ROUND_1, ROUND_END_ASKED, kill_b, reference_run, two_nodes  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 8
HOLD = 3  # generation windows are 4 steps (2 iterations x 2 steps per generation): step 3 lies inside one


def _losses(path: Path) -> dict[int, tuple[float, float, float]]:
    """Step -> (loss, grad norm, epoch), the last line of each step (a resumed run logs its steps again)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["step"]] = (row["loss"], row["grad_norm"], row["epoch"])
    return out


def _logged_steps(path: Path) -> list[int]:
    """Every step logged, in order, repeats included."""
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


def _job(tmp: Path, name: str, etcd: str, job_id: str, *extra: str, nnodes: str = "1", nproc: int = 2,
         steps: int = STEPS, launch: tuple[str, ...] = ("--first-round-wait", "1")) -> list[str]:
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--lease-ttl", "2", *launch, *FAST_WARM, "-m", "ftrt.examples.trl_grpo",
            "--out", str(tmp / f"{name}-out"), "--steps", str(steps), "--metrics", str(tmp / f"{name}.jsonl"),
            "--ledger", str(tmp / f"{name}-ledger.jsonl"), *extra]


def _generations(path: Path) -> list[list[str]]:
    """The prompts of every generation the finished run trained on, in order: a worker that starts
    at step s (a resume) discards what earlier rounds generated at step s or later."""
    kept: list[dict] = []
    for row in (json.loads(x) for x in path.read_text().splitlines()):
        if "start" in row:
            kept = [k for k in kept if k["round"] >= row["round"] or k["step"] < row["start"]]
        else:
            kept.append(row)
    by_step: dict[int, list[str]] = {}
    for k in kept:
        by_step.setdefault(k["step"], []).extend(k["prompts"])
    return [sorted(by_step[s]) for s in sorted(by_step)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, etcd_server):
    """The uninterrupted run: its losses by step and its output folder."""
    tmp, got = reference_run(tmp_path_factory, etcd_server.endpoint, "trl",
                             lambda tmp, etcd, job: _job(tmp, "ref", etcd, job), _losses, STEPS)
    # an epoch is 16 steps here (4 generations of 4 steps): the epoch logged is where the data stand
    assert {step: got[step][2] for step in got} == {step: step / 16 for step in got}
    return got, tmp / "ref-out"


@pytest.fixture(scope="module")
def reference(finished):
    return finished[0]


def _killed_inside_a_window(tmp: Path, etcd: str, job_id: str, mode: str) -> tuple[dict, str]:
    hold = tmp / "go"
    node = Node(tmp, "a", _job(tmp, "run", etcd, job_id, "--ftrt", mode, "--hold-after", str(HOLD),
                               "--hold-file", str(hold))).start()
    try:
        # every rank waits after step 3's committed checkpoint: the kill lands inside the window
        wait_until(lambda: (tmp / "run-out" / f"checkpoint-{HOLD}" / "manifest.json").exists(), 180, "step 3's commit")
        os.kill(worker_pids(etcd, job_id)[1], signal.SIGKILL)
        hold.touch()
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert "round 2: started ranks" in node.log()  # the kill restarted the workers, which resumed
    return _losses(tmp / "run.jsonl"), node.log()


def test_a_worker_killed_inside_a_generation_window_resumes_with_bit_identical_losses(tmp_path, reference,
                                                                                       etcd_endpoint, job_id):
    got, _ = _killed_inside_a_window(tmp_path, etcd_endpoint, job_id, "trl")
    # every step's loss, grad norm and logged epoch, bit for bit, steps 4-8 after the resume (the
    # Trainer, which ftrt makes skip nothing, would log epoch 0.0625 at step 4)
    assert got == reference


def test_a_finished_job_launched_again_trains_nothing(tmp_path, finished, etcd_endpoint, job_id):
    _, out = finished
    shutil.copytree(out, tmp_path / "run-out")  # as if a worker died after the final commit: same folder
    node = Node(tmp_path, "a", _job(tmp_path, "run", etcd_endpoint, job_id)).start()
    try:
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert "Training is already finished: the run resumed at step 8 of max_steps 8" in node.log(), node.log()[-3000:]
    assert _logged_steps(tmp_path / "run.jsonl") == []  # TRL alone trains step 9 (with a zero learning rate)
    assert not (tmp_path / "run-out" / f"checkpoint-{STEPS + 1}").exists()


def test_a_node_joining_inside_a_generation_window_ends_the_round_at_its_end_and_nothing_is_redone(
        tmp_path, etcd_endpoint, job_id):
    from ftrt.examples.trl_grpo import PROMPTS
    from ftrt.integrations.trl import GenerationOrder

    # a alone: a window is 8 steps (a generation of 8 completions at 2 a step, 2 iterations of 4
    # steps). b joins while a is held after step 1; the ranks agree on it after step 3, and the
    # round ends after step 8, not 3: 5 steps of 1 s, longer than the agent's plain wait (3 steps
    # and a second), which it extends. Round 2 (windows of 4 steps at world 2) resumes from
    # checkpoint-8 with nothing trained twice.
    steps, hold = 16, 1
    args = _job(tmp_path, "run", etcd_endpoint, job_id, "--hold-after", str(hold), "--hold-file",
                str(tmp_path / "go"), "--step-time", "1", nnodes="1:2", nproc=1, steps=steps)
    a = Node(tmp_path, "a", args).start()
    nodes = [a]
    try:
        wait_until(lambda: (tmp_path / "run-out" / f"checkpoint-{hold}" / "manifest.json").exists(), 180,
                   "step 1's commit")
        nodes.append(Node(tmp_path, "b", args).start())
        wait_until(lambda: ROUND_END_ASKED in a.log(), 120, "a's round to be asked to end")
        (tmp_path / "go").touch()
        assert a.wait(240) == 0, a.log()[-3000:]
        assert nodes[1].wait(60) == 0, nodes[1].log()[-3000:]
    finally:
        for n in nodes:
            n.cleanup()
    log = a.log()
    assert "round 1 ends after step 8, where its workers said they would end it" in log, log[-3000:]
    assert "s more" in log.split("round 1 ends after step 8", 1)[1].splitlines()[0]  # the agent waited longer
    assert "round 1 ended at a step boundary (step 8)" in log, log[-3000:]
    assert _logged_steps(tmp_path / "run.jsonl") == list(range(1, steps + 1)), "a step was trained twice"
    epochs = {step: epoch for step, (_, _, epoch) in _losses(tmp_path / "run.jsonl").items()}
    assert (epochs[8], epochs[12], epochs[16]) == (0.25, 0.5, 0.75), epochs  # 1, 2 and 3 generations of 4
    ledger = [json.loads(x) for x in (tmp_path / "run-ledger.jsonl").read_text().splitlines()]
    assert sorted((r["round"], r["rank"], r["start"]) for r in ledger if "start" in r) == [
        (1, 0, 0), (2, 0, 8), (2, 1, 8)]
    order = GenerationOrder(len(PROMPTS), 4, 2, 1, seed=0)
    got = _generations(tmp_path / "run-ledger.jsonl")
    # one generation at world 1 (steps 1-8), two at world 2 (steps 9-12, 13-16)
    assert got == [sorted(PROMPTS[i] for i in order.chunk(g) for _ in range(2)) for g in range(3)], got


@pytest.mark.xfail(strict=True, reason="TRL does not checkpoint its generation buffer (trl #3247): a resume inside "
                   "a window regenerates at the wrong step")
def test_without_ftrt_s_trl_support_the_same_crash_diverges(tmp_path, reference, etcd_endpoint, job_id):
    got, _ = _killed_inside_a_window(tmp_path, etcd_endpoint, job_id, "hf")
    assert sorted(got) == list(range(1, STEPS + 1))  # it does finish: the failure is the losses
    assert got == reference


def test_a_lost_node_shrinks_the_world_and_trains_every_prompt_exactly_once(tmp_path, etcd_endpoint, job_id):
    from ftrt.examples.trl_grpo import PROMPTS
    from ftrt.integrations.trl import GenerationOrder

    steps, hold = 16, 6  # windows are 4 steps at world 2 and 8 at world 1: step 6 lies inside one
    args = _job(tmp_path, "run", etcd_endpoint, job_id, "--hold-after", str(hold), "--hold-file",
                str(tmp_path / "go"), nnodes="1:2", nproc=1, steps=steps, launch=BOTH_IN_ROUND_1)
    def lose_b_then_go_on(nodes):
        kill_b(nodes)
        (tmp_path / "go").touch()

    nodes = two_nodes(tmp_path, args, lambda: (tmp_path / "run-out" / f"checkpoint-{hold}" / "manifest.json").exists(),
                      "step 6's commit", lose_b_then_go_on)
    log = nodes["a"].log()
    assert "checkpoint-6: it lies inside a generation window" in log, log[-3000:]  # back to a window boundary
    assert "checkpoint-4 was saved by 2 ranks, this run has 1" in log, log[-3000:]
    assert sorted(_losses(tmp_path / "run.jsonl")) == list(range(1, steps + 1))
    epochs = {step: epoch for step, (_, _, epoch) in _losses(tmp_path / "run.jsonl").items()}
    # the data's position: 1 generation of 4 a window at world 2, then at world 1 (windows of 8 steps)
    assert epochs[4] == 0.25 and epochs[8] == 0.375 and epochs[12] == 0.5 and epochs[16] == 0.625, epochs
    order = GenerationOrder(len(PROMPTS), 4, 2, 1, seed=0)
    got = _generations(tmp_path / "run-ledger.jsonl")
    # 3 generations: one at world 2 (steps 1-4), two at world 1 (steps 5-12, 13-16); each prompt of
    # a generation twice (num_generations), none in two generations of the epoch
    assert got == [sorted(PROMPTS[i] for i in order.chunk(g) for _ in range(2)) for g in range(3)], got


def test_a_drained_node_ends_the_round_at_the_window_end_and_nothing_is_redone(tmp_path, etcd_endpoint, job_id):
    from ftrt.examples.trl_grpo import PROMPTS
    from ftrt.integrations.trl import GenerationOrder

    # a and b at world 2: windows of 4 steps. b drains while both are held after step 5 (inside the
    # second window): the round ends after step 8, and a goes on alone (windows of 8) from there.
    steps, hold = 16, 5
    args = _job(tmp_path, "run", etcd_endpoint, job_id, "--hold-after", str(hold), "--hold-file",
                str(tmp_path / "go"), nnodes="1:2", nproc=1, steps=steps, launch=BOTH_IN_ROUND_1)

    def drain_b_then_go_on(nodes):  # the workers wait after step 5 until the drain asked the round to end
        asked = nodes["a"].log().count(ROUND_END_ASKED)
        nodes["b"].proc.send_signal(signal.SIGTERM)
        wait_until(lambda: nodes["a"].log().count(ROUND_END_ASKED) > asked, 60, "a's round to be asked to end")
        (tmp_path / "go").touch()
        assert nodes["b"].wait(60) == 0, nodes["b"].log()[-3000:]

    nodes = two_nodes(tmp_path, args, lambda: (tmp_path / "run-out" / f"checkpoint-{hold}" / "manifest.json").exists(),
                      "step 5's commit", drain_b_then_go_on)
    log = nodes["a"].log()
    assert "ended at a step boundary (step 8)" in log, log[-3000:]
    assert _logged_steps(tmp_path / "run.jsonl") == list(range(1, steps + 1)), "a step was trained twice"
    order = GenerationOrder(len(PROMPTS), 4, 2, 1, seed=0)
    # two generations at world 2 (steps 1-4, 5-8), one at world 1 (steps 9-16)
    got = _generations(tmp_path / "run-ledger.jsonl")
    assert got == [sorted(PROMPTS[i] for i in order.chunk(g) for _ in range(2)) for g in range(3)], got
