"""The Hugging Face Trainer under ftrt (``ftrt.integrations.hf``): a real Trainer, 2 ranks on gloo,
real agents on a real etcd, a real SIGKILL; losses compared bit for bit with the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (in the test extra)")

from ftrt.chaos.local import worker_pids  # noqa: E402
from tests.agents.harness import FAST_WARM, Node, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 12


def _losses(path: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm), the last line of each step (a resumed run logs its steps again)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["step"]] = (row["loss"], row["grad_norm"])
    return out


def _job(tmp: Path, name: str, etcd: str, job_id: str) -> list[str]:
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", "1", "--nproc-per-node", "2", "--lease-ttl", "2",
            "--first-round-wait", "1", *FAST_WARM, "-m", "ftrt.examples.hf_trainer", "--out", str(tmp / f"{name}-out"),
            "--steps", str(STEPS), "--metrics", str(tmp / f"{name}.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    tmp = tmp_path_factory.mktemp("hf-ref")
    node = Node(tmp, "ref", _job(tmp, "ref", etcd_server.endpoint, "hf-ref")).start()
    try:
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    got = _losses(tmp / "ref.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    return got, tmp / "ref-out"


def test_a_killed_worker_resumes_the_trainer_with_bit_identical_losses(tmp_path, reference, etcd_endpoint, job_id):
    ref, _ = reference
    node = Node(tmp_path, "a", _job(tmp_path, "run", etcd_endpoint, job_id)).start()
    try:
        wait_until(lambda: len(_losses(tmp_path / "run.jsonl")) >= 6, 180, "step 6")
        os.kill(worker_pids(etcd_endpoint, job_id)[1], signal.SIGKILL)
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert "round 2: started ranks" in node.log()  # the kill restarted the workers, which resumed
    assert _losses(tmp_path / "run.jsonl") == ref  # every step's loss and grad norm, bit for bit


def test_resume_skips_a_checkpoint_whose_commit_never_happened_or_whose_file_changed(tmp_path, reference):
    from ftrt.integrations.hf import resume_checkpoint

    _, out = reference
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    assert resume_checkpoint(str(copy)) == str(copy / f"checkpoint-{STEPS}")
    (copy / f"checkpoint-{STEPS}" / "manifest.json").unlink()  # killed between its data and its commit
    assert resume_checkpoint(str(copy)) == str(copy / f"checkpoint-{STEPS - 1}")
    with open(copy / f"checkpoint-{STEPS - 1}" / "optimizer.pt", "ab") as f:
        f.write(b"x")  # damaged after its commit: never loaded (torch.load is a pickle)
    assert resume_checkpoint(str(copy)) == str(copy / f"checkpoint-{STEPS - 2}")


def test_the_example_runs_alone_without_ftrt_launch(tmp_path):
    res = subprocess.run([sys.executable, "-m", "ftrt.examples.hf_trainer", "--out", str(tmp_path / "o"),
                          "--steps", "3", "--metrics", str(tmp_path / "m.jsonl")], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(_losses(tmp_path / "m.jsonl")) == [1, 2, 3]
