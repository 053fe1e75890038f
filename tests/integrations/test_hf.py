"""The Hugging Face Trainer under ftrt (``ftrt.integrations.hf``): a real Trainer, 2 ranks on gloo,
real agents on a real etcd, a real SIGKILL; losses compared bit for bit with the uninterrupted run.
A lost node with ``ElasticTrainer``: every global batch trained exactly once, proved by the ledger of
sample ids each rank fed its model; the plain Trainer after a world-size change repeats samples."""

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
from tests.integrations.kit import BOTH_IN_ROUND_1, drain_b, kill_b, reference_run, two_nodes  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 12
ELASTIC = ("--elastic", "--global-batch", "6", "--grad-accum", "2")  # 10 steps an epoch: runs cross one


def _losses(path: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm), the last line of each step (a resumed run logs its steps again)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["step"]] = (row["loss"], row["grad_norm"])
    return out


def _ledger(path: Path) -> dict[int, list[dict]]:
    """Step -> the ``--ledger`` lines of its last attempt (highest round), one per rank, by rank."""
    attempts: dict[int, dict[int, list[dict]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            attempts.setdefault(row["step"], {}).setdefault(row["round"], []).append(row)
    return {step: sorted(by_round[max(by_round)], key=lambda r: r["rank"]) for step, by_round in attempts.items()}


def _trained(path: Path) -> dict[int, list[int]]:
    """Step -> the sample ids its last attempt trained, over all ranks (checked: every rank wrote)."""
    out = {}
    for step, rows in _ledger(path).items():
        assert [r["rank"] for r in rows] == list(range(rows[0]["world"])), f"step {step}: ranks missing in {rows}"
        out[step] = [i for r in rows for i in r["ids"]]
    return out


def _job(tmp: Path, name: str, etcd: str, job_id: str, nnodes: str = "1", nproc: int = 2,
         extra: tuple[str, ...] = (), launch: tuple[str, ...] = ("--first-round-wait", "1")) -> list[str]:
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--lease-ttl",
            "2", *launch, *FAST_WARM, "-m", "ftrt.examples.hf_trainer", "--out",
            str(tmp / f"{name}-out"), "--steps", str(STEPS), "--metrics", str(tmp / f"{name}.jsonl"),
            "--ledger", str(tmp / f"{name}-ledger.jsonl"), *extra]


def _example(*args: str) -> None:
    """The example as a plain script: one process, a world of one."""
    res = subprocess.run([sys.executable, "-m", "ftrt.examples.hf_trainer", *args], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]


def _keep_checkpoints_up_to(out: Path, copy: Path, step: int) -> None:
    """``copy``: ``out`` as if the run had been killed after committing ``step``."""
    shutil.copytree(out, copy)
    for folder in copy.glob("checkpoint-*"):
        if int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    tmp, got = reference_run(tmp_path_factory, etcd_server.endpoint, "hf",
                             lambda tmp, etcd, job: _job(tmp, "ref", etcd, job), _losses, STEPS)
    return got, tmp / "ref-out", _trained(tmp / "ref-ledger.jsonl")


def test_a_killed_worker_resumes_the_trainer_with_bit_identical_losses(tmp_path, reference, etcd_endpoint, job_id):
    ref, _, _ = reference
    node = Node(tmp_path, "a", _job(tmp_path, "run", etcd_endpoint, job_id)).start()
    try:
        wait_until(lambda: len(_losses(tmp_path / "run.jsonl")) >= 6, 180, "step 6")
        os.kill(worker_pids(etcd_endpoint, job_id)[1], signal.SIGKILL)
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    assert "round 2: started ranks" in node.log()  # the kill restarted the workers, which resumed
    assert _losses(tmp_path / "run.jsonl") == ref  # every step's loss and grad norm, bit for bit


def test_a_worker_killed_after_the_final_checkpoint_trains_no_step_past_the_end(tmp_path, reference, etcd_endpoint,
                                                                                 job_id):
    ref, _, _ = reference
    hold = tmp_path / "go"
    node = Node(tmp_path, "a", _job(tmp_path, "run", etcd_endpoint, job_id,
                                    extra=("--hold-after", str(STEPS), "--hold-file", str(hold)))).start()
    try:
        # every rank waits after the final checkpoint's commit: the kill lands before the job ends
        wait_until(lambda: (tmp_path / "run-out" / f"checkpoint-{STEPS}" / "manifest.json").exists(), 180,
                   "the final commit")
        os.kill(worker_pids(etcd_endpoint, job_id)[1], signal.SIGKILL)
        hold.touch()
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
    log = node.log()
    assert "round 2: started ranks" in log  # the kill restarted the workers, which resumed from the end
    assert f"Training is already finished: the run resumed at step {STEPS} of max_steps {STEPS}" in log, log[-3000:]
    assert _losses(tmp_path / "run.jsonl") == ref  # steps 1-12, bit for bit; the Trainer alone trains a 13th
    assert not (tmp_path / "run-out" / f"checkpoint-{STEPS + 1}").exists()


@pytest.mark.parametrize("trainer", [(), ("--elastic", "--global-batch", "16", "--grad-accum", "2")],
                         ids=["Trainer", "ElasticTrainer"])
def test_a_finished_run_started_again_in_its_folder_trains_nothing(tmp_path, trainer):
    run = ("--out", str(tmp_path / "out"), "--steps", "5", "--metrics", str(tmp_path / "m.jsonl"), *trainer)
    _example(*run)  # 5 steps end inside an epoch (32 steps at world 1; 4 with ElasticTrainer's batches)
    res = subprocess.run([sys.executable, "-m", "ftrt.examples.hf_trainer", *run], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Training is already finished: the run resumed at step 5 of max_steps 5" in res.stderr, res.stderr[-3000:]
    logged = [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5]  # by the first run only: the second trained nothing
    assert not (tmp_path / "out" / "checkpoint-6").exists()


def test_resume_skips_a_checkpoint_whose_commit_never_happened_or_whose_file_changed(tmp_path, reference):
    from ftrt.integrations.hf import resume_checkpoint

    _, out, _ = reference
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


def _elastic_order() -> dict[int, list[int]]:
    """Step -> the sample ids the example's ElasticSampler order trains (64 samples, --global-batch 6, seed 0)."""
    from ftrt.data import ElasticSampler

    order = ElasticSampler(64, 6, seed=0)
    per_epoch = order.epoch_samples // order.global_batch
    want = {}
    for step in range(1, STEPS + 1):
        epoch, k = divmod(step - 1, per_epoch)
        want[step] = order.ledger(epoch, k * order.global_batch)
    return want


def _two_elastic_nodes(tmp: Path, etcd: str, job_id: str, ledger: Path, fault) -> dict:
    """An ElasticTrainer job on nodes a and b (1:2), ``fault`` applied after 5 steps at world size 2."""
    return two_nodes(tmp, _job(tmp, "run", etcd, job_id, "1:2", 1, ELASTIC, BOTH_IN_ROUND_1),
                     lambda: sum(rows[0]["world"] == 2 for rows in _ledger(ledger).values()) >= 5,
                     "5 steps at world size 2", fault)


def test_a_lost_node_shrinks_the_elastic_trainer_which_trains_every_global_batch_exactly_once(tmp_path, etcd_endpoint,
                                                                                              job_id):
    ledger = tmp_path / "run-ledger.jsonl"
    nodes = _two_elastic_nodes(tmp_path, etcd_endpoint, job_id, ledger, kill_b)
    last = _ledger(ledger)
    worlds = [last[step][0]["world"] for step in sorted(last)]
    assert worlds[0] == 2 and worlds[-1] == 1 and worlds == sorted(worlds, reverse=True), worlds
    assert _trained(ledger) == _elastic_order(), "a sample was skipped or repeated"
    assert "not bit-identical" in nodes["a"].log()  # the world-size change is announced


def test_a_drained_node_ends_the_round_at_a_step_boundary_and_no_step_is_trained_twice(tmp_path, etcd_endpoint,
                                                                                         job_id):
    ledger = tmp_path / "run-ledger.jsonl"
    nodes = _two_elastic_nodes(tmp_path, etcd_endpoint, job_id, ledger, drain_b)
    assert "ended at a step boundary" in nodes["a"].log(), nodes["a"].log()[-3000:]
    logged = [json.loads(x)["step"] for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1)), "a step was trained twice (or skipped)"
    assert _trained(ledger) == _elastic_order(), "a sample was skipped or repeated"


def test_without_the_elastic_sampler_a_world_size_change_repeats_samples(tmp_path, reference):
    _, out, trained = reference  # the plain Trainer on 2 ranks
    copy = tmp_path / "out"
    _keep_checkpoints_up_to(out, copy, 5)
    _example("--out", str(copy), "--steps", str(STEPS), "--ledger", str(tmp_path / "ledger.jsonl"))  # on 1 rank
    resumed = _trained(tmp_path / "ledger.jsonl")
    assert sorted(resumed) == list(range(6, STEPS + 1))
    uninterrupted = [i for step in range(1, STEPS + 1) for i in trained[step]]
    assert len(uninterrupted) <= 64 and len(set(uninterrupted)) == len(uninterrupted)  # one epoch: all new
    ids = [i for step in range(1, 6) for i in trained[step]] + [i for step in resumed for i in resumed[step]]
    assert len(set(ids)) < len(ids), "the plain Trainer was expected to repeat samples after the change"


def test_the_elastic_trainer_refuses_a_checkpoint_without_its_data_position(tmp_path, reference):
    _, out, _ = reference  # written by the plain Trainer: where its data stood is unknown
    _keep_checkpoints_up_to(out, tmp_path / "out", STEPS)
    res = subprocess.run([sys.executable, "-m", "ftrt.examples.hf_trainer", "--out", str(tmp_path / "out"), "--steps",
                          str(STEPS + 1), "--elastic"], capture_output=True, text=True, timeout=240)
    assert res.returncode != 0 and f"checkpoint-{STEPS} has no ftrt_sampler.json" in res.stderr, res.stderr[-3000:]


def test_the_elastic_trainer_resumes_at_the_same_world_size_bit_identically(tmp_path):
    elastic = ("--elastic", "--global-batch", "16", "--grad-accum", "2", "--steps", "6")  # 4 steps an epoch
    _example("--out", str(tmp_path / "ref"), "--metrics", str(tmp_path / "ref.jsonl"),
             "--ledger", str(tmp_path / "ref-ledger.jsonl"), *elastic)
    _keep_checkpoints_up_to(tmp_path / "ref", tmp_path / "run", 3)  # resumed mid-epoch, then across its end
    _example("--out", str(tmp_path / "run"), "--metrics", str(tmp_path / "run.jsonl"),
             "--ledger", str(tmp_path / "run-ledger.jsonl"), *elastic)
    ref, run = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "run.jsonl")
    assert sorted(run) == [4, 5, 6] and run == {step: ref[step] for step in run}
    ref_ids = _trained(tmp_path / "ref-ledger.jsonl")
    assert _trained(tmp_path / "run-ledger.jsonl") == {step: ref_ids[step] for step in (4, 5, 6)}


def test_the_callback_destroys_the_process_group_at_exit_which_the_trainer_leaves_up(tmp_path):
    # A gloo group alive at interpreter finalization can abort the process (pytorch #190489): under
    # ftrt launch, a failed worker after the job's end. The callback has it destroyed at exit once
    # training ended. atexit runs handlers last in, first out, so the probe registered before sees
    # the group as the callback's handler left it.
    script = f"""
import atexit
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
atexit.register(lambda: print("group up at exit:", dist.is_initialized()))
from types import SimpleNamespace
from ftrt.integrations.hf import FtrtCallback
cb = FtrtCallback()
state = SimpleNamespace(global_step=3, max_steps=3)
cb.on_train_end(None, state, None)
cb.on_train_end(None, state, None)  # registered once
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines() == ["group up at exit: False"], res.stdout


def test_before_transformers_5_25_only_the_elastic_loaders_pass_the_trainers_skip(monkeypatch):
    """transformers 5.24 skips resumed batches with its module's skip_first_batches (no hook): the
    wrapper ElasticData installs lets its own loaders pass and skips every other loader as before."""
    import torch
    import transformers.trainer as hf_trainer

    from ftrt.integrations.hf import _ELASTIC_LOADER, _let_elastic_loaders_pass

    calls = []
    monkeypatch.setattr(hf_trainer, "skip_first_batches", lambda loader, num_batches=0: calls.append(num_batches))
    _let_elastic_loaders_pass()
    _let_elastic_loaders_pass()  # once per process: not wrapped twice
    ours, other = (torch.utils.data.DataLoader(list(range(8)), batch_size=2) for _ in range(2))
    setattr(ours, _ELASTIC_LOADER, True)
    assert hf_trainer.skip_first_batches(ours, 3) is ours and calls == []
    hf_trainer.skip_first_batches(other, 3)
    assert calls == [3]
