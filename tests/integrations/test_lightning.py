"""PyTorch Lightning under ftrt (``ftrt.integrations.lightning``): real Lightning DDP, 2 ranks on gloo,
real agents on a real etcd, real SIGKILLs; losses compared bit for bit with the uninterrupted run,
and the sample ledger checked against ``ElasticSampler``'s order after a node is lost."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("lightning") is None:
    pytest.importorskip("pytorch_lightning", reason="the lightning extra (pytorch-lightning) is not installed")

from ftrt.chaos.local import worker_pids  # noqa: E402
from ftrt.data import ElasticSampler  # noqa: E402
from ftrt.examples.lightning_steps import GLOBAL_BATCH, SAMPLES  # noqa: E402
from tests.agents.harness import FAST_WARM, Node, wait_until  # noqa: E402
from tests.integrations.kit import BOTH_IN_ROUND_1, drain_b, kill_b, reference_run, two_nodes  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 16  # two epochs of 8 global batches
EXAMPLE = "ftrt.examples.lightning_steps"


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def _losses(path: Path) -> dict[int, float]:
    """Step -> loss, the last line of each step (a resumed run logs its redone steps again)."""
    return {row["step"]: row["loss"] for row in _rows(path)}


def _job(tmp: Path, name: str, etcd: str, job_id: str, nnodes: str = "1", nproc: int = 2,
         step_time: float = 0.0, launch: tuple[str, ...] = ("--first-round-wait", "1")) -> list[str]:
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--lease-ttl", "2", *launch, *FAST_WARM, "--warm-import", "pytorch_lightning",
            "-m", EXAMPLE, "--out", str(tmp / f"{name}-out"), "--steps", str(STEPS), "--step-time", str(step_time),
            "--metrics", str(tmp / f"{name}.jsonl"), "--ledger", str(tmp / f"{name}.ledger")]


def _alone(out: Path, metrics: Path) -> None:
    res = subprocess.run([sys.executable, "-m", EXAMPLE, "--out", str(out), "--steps", str(STEPS),
                          "--metrics", str(metrics)], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    tmp, got = reference_run(tmp_path_factory, etcd_server.endpoint, "lightning",
                             lambda tmp, etcd, job: _job(tmp, "ref", etcd, job), _losses, STEPS)
    return got, tmp / "ref-out"


def test_a_killed_worker_resumes_lightning_with_bit_identical_losses(tmp_path, reference, etcd_endpoint, job_id):
    ref, _ = reference
    node = Node(tmp_path, "a", _job(tmp_path, "run", etcd_endpoint, job_id, step_time=0.3)).start()
    try:
        wait_until(lambda: len(_losses(tmp_path / "run.jsonl")) >= 6, 180, "step 6")
        os.kill(worker_pids(etcd_endpoint, job_id)[1], signal.SIGKILL)
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert "round 2: started ranks" in node.log()  # the kill restarted the workers, which resumed
    assert _losses(tmp_path / "run.jsonl") == ref  # every step's loss, bit for bit


def _two_nodes(tmp: Path, etcd: str, job_id: str, fault) -> dict:
    """A Lightning job on nodes a and b (1:2), ``fault`` applied after 6 steps at world size 2."""
    return two_nodes(tmp, _job(tmp, "run", etcd, job_id, nnodes="1:2", nproc=1, step_time=0.3, launch=BOTH_IN_ROUND_1),
                     lambda: sum(r["world"] == 2 for r in _rows(tmp / "run.jsonl")) >= 6, "6 steps at world size 2",
                     fault)


def test_a_lost_node_shrinks_the_world_and_trains_every_global_batch_once(tmp_path, etcd_endpoint, job_id):
    _two_nodes(tmp_path, etcd_endpoint, job_id, kill_b)
    worlds = {row["step"]: row["world"] for row in _rows(tmp_path / "run.jsonl")}
    assert sorted(worlds) == list(range(1, STEPS + 1)) and worlds[1] == 2 and worlds[STEPS] == 1, worlds
    # The attempt that counts for a step is its last round's; its ranks' shares, in rank order, must be
    # exactly the global batch ElasticSampler puts at that step: nothing skipped or repeated.
    attempts: dict[int, dict[int, list[dict]]] = {}
    for row in _rows(tmp_path / "run.ledger"):
        attempts.setdefault(row["step"], {}).setdefault(row["round"], []).append(row)
    order = ElasticSampler(SAMPLES, GLOBAL_BATCH, seed=0)
    per_epoch = SAMPLES // GLOBAL_BATCH
    assert sorted(attempts) == list(range(1, STEPS + 1))
    for step, rounds in attempts.items():
        last = sorted(rounds[max(rounds)], key=lambda row: row["rank"])
        assert [row["rank"] for row in last] == list(range(last[0]["world"])), (step, last)
        epoch, index = divmod(step - 1, per_epoch)
        assert [i for row in last for i in row["ids"]] == order.ledger(epoch, index * GLOBAL_BATCH), step


def test_a_drained_node_ends_the_round_at_a_step_boundary_and_no_step_is_trained_twice(tmp_path, etcd_endpoint,
                                                                                         job_id):
    nodes = _two_nodes(tmp_path, etcd_endpoint, job_id, drain_b)
    assert "ended at a step boundary" in nodes["a"].log(), nodes["a"].log()[-3000:]
    steps = [row["step"] for row in _rows(tmp_path / "run.jsonl")]
    assert steps == list(range(1, STEPS + 1)), "a step was trained twice (or skipped)"
    order = ElasticSampler(SAMPLES, GLOBAL_BATCH, seed=0)
    per_epoch = SAMPLES // GLOBAL_BATCH
    trained: dict[int, list[int]] = {}
    for row in sorted(_rows(tmp_path / "run.ledger"), key=lambda row: (row["step"], row["rank"])):
        trained.setdefault(row["step"], []).extend(row["ids"])
    assert trained == {step: order.ledger((step - 1) // per_epoch, (step - 1) % per_epoch * GLOBAL_BATCH)
                       for step in range(1, STEPS + 1)}, "a sample was skipped or repeated"


def test_resume_skips_a_checkpoint_whose_commit_never_happened_or_whose_file_changed(tmp_path, reference):
    from ftrt.errors import CheckpointCorrupt
    from ftrt.integrations.lightning import FtrtCheckpointIO, resume_checkpoint

    _, out = reference
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    assert resume_checkpoint(str(copy)) == str(copy / f"step-{STEPS}.ckpt")
    (copy / f"step-{STEPS}.ckpt" / "manifest.json").unlink()  # killed between its data and its commit
    assert resume_checkpoint(str(copy)) == str(copy / f"step-{STEPS - 1}.ckpt")
    with open(copy / f"step-{STEPS - 1}.ckpt" / "checkpoint.pt", "ab") as f:
        f.write(b"x")  # damaged after its commit: never loaded (torch.load is a pickle)
    assert resume_checkpoint(str(copy)) == str(copy / f"step-{STEPS - 2}.ckpt")
    io = FtrtCheckpointIO()
    with pytest.raises(CheckpointCorrupt, match="has .* bytes"):
        io.load_checkpoint(copy / f"step-{STEPS - 1}.ckpt")
    assert io.load_checkpoint(copy / f"step-{STEPS - 2}.ckpt")["global_step"] == STEPS - 2


def test_a_save_returns_before_its_write_and_commits_a_copy_of_the_tensors(tmp_path):
    import torch

    from ftrt.integrations.lightning import FtrtCheckpointIO, resume_checkpoint

    io = FtrtCheckpointIO()
    weights = torch.arange(4.0)
    io.save_checkpoint({"global_step": 3, "w": weights}, tmp_path / "step-3.ckpt")
    weights += 1  # training goes on while the save is written
    io.save_checkpoint({"global_step": 4, "w": weights}, tmp_path / "step-4.ckpt")
    io.remove_checkpoint(tmp_path / "step-3.ckpt")  # after the save in flight
    io.teardown()
    assert resume_checkpoint(str(tmp_path)) == str(tmp_path / "step-4.ckpt")
    assert not (tmp_path / "step-3.ckpt").exists()
    assert io.load_checkpoint(tmp_path / "step-4.ckpt")["w"].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning-alone")
    _alone(tmp / "out", tmp / "m.jsonl")
    return _losses(tmp / "m.jsonl"), tmp / "out"


def test_the_example_runs_alone_without_ftrt_launch(alone):
    losses, out = alone
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in out.iterdir()) == sorted(f"step-{s}.ckpt" for s in range(1, STEPS + 1))


def test_a_finished_run_started_again_in_its_folder_trains_nothing(tmp_path, alone):
    _, out = alone
    shutil.copytree(out, tmp_path / "out")
    _alone(tmp_path / "out", tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists() or _losses(tmp_path / "m.jsonl") == {}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"step-{s}.ckpt" for s in range(1, STEPS + 1))


@pytest.mark.parametrize("at", [8, 6], ids=["epoch-end", "mid-epoch"])
def test_a_resume_at_an_epoch_end_or_mid_epoch_is_bit_identical(tmp_path, alone, at):
    # The random states come back at different moments in the two cases (the module docstring):
    # either one restored at the other's moment changes every loss after the resume.
    losses, out = alone
    shutil.copytree(out, tmp_path / "out")
    for step in range(at + 1, STEPS + 1):
        shutil.rmtree(tmp_path / "out" / f"step-{step}.ckpt")
    _alone(tmp_path / "out", tmp_path / "m.jsonl")
    resumed = _losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == list(range(at + 1, STEPS + 1))
    assert resumed == {s: losses[s] for s in resumed}
