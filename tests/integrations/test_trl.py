"""TRL's GRPOTrainer under ftrt (``ftrt.integrations.trl``): a real GRPOTrainer generating with a
tiny Llama, 2 ranks on gloo, real agents on a real etcd, a real SIGKILL inside a generation window;
losses compared bit for bit with the uninterrupted run. The same crash with only the Hugging Face
callback (TRL's own resume) diverges: the upstream gap, kept as an expected failure."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed")

from ftrt.chaos.local import worker_pids  # noqa: E402
from tests.agents.harness import FAST_WARM, Node, wait_until  # noqa: E402
from tests.integrations.kit import BOTH_IN_ROUND_1, kill_b, reference_run, two_nodes  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 8
HOLD = 3  # generation windows are 4 steps (2 iterations x 2 steps per generation): step 3 lies inside one


def _losses(path: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm), the last line of each step (a resumed run logs its steps again)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["step"]] = (row["loss"], row["grad_norm"])
    return out


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
def reference(tmp_path_factory, etcd_server):
    _, got = reference_run(tmp_path_factory, etcd_server.endpoint, "trl",
                           lambda tmp, etcd, job: _job(tmp, "ref", etcd, job), _losses, STEPS)
    return got


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
    assert got == reference  # every step's loss and grad norm, bit for bit, steps 4-8 after the resume


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
    order = GenerationOrder(len(PROMPTS), 4, 2, 1, seed=0)
    got = _generations(tmp_path / "run-ledger.jsonl")
    # 3 generations: one at world 2 (steps 1-4), two at world 1 (steps 5-12, 13-16); each prompt of
    # a generation twice (num_generations), none in two generations of the epoch
    assert got == [sorted(PROMPTS[i] for i in order.chunk(g) for _ in range(2)) for g in range(3)], got
