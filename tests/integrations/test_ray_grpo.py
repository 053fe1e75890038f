"""The GRPO trainer as a single-controller Ray program (``python -m ftrt.grpo.ray``) on real Ray
clusters of raylets on this machine (loopback), against ``ftrt launch -m ftrt.grpo``.

What must hold: at the same world size the Ray driver writes the launched trainer's metrics bit for
bit (same shares, seeds and update); a driver started again resumes from its checkpoint and ends
where an uninterrupted run ends; a Ray node lost while every rank is inside a step's update costs
no prompt (each step's prompts trained once, in order), restarts no surviving worker, and leaves
the steps before the loss bit-identical to the fault-free run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ftrt[ray]')")

from ftrt import envnames  # noqa: E402
from ftrt.chaos.local import wait_until  # noqa: E402
from ftrt.grpo.config import load_config  # noqa: E402
from ftrt.grpo.ray import WORKER, Driver  # noqa: E402
from ftrt.integrations.ray import ElasticGroup, loopback_cluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = ["prompts_per_step=6", "group_size=4", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
          "progress=none"]
EXACT = ("step", "reward_mean", "loss", "kl", "grad_norm", "world_size", "prompt_ids")


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def exact(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in EXACT} for r in rows]


def launched(tmp: Path, nproc: int, *overrides: str) -> list[dict]:
    """The metrics of ``ftrt launch --standalone --nproc-per-node nproc -m ftrt.grpo``."""
    out = tmp / f"launch-{nproc}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", str(nproc),
                           "-m", "ftrt.grpo", *CONFIG, *overrides, f"metrics_path={out}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return lines(out)


def ray_cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrt.grpo.ray", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp)


def test_the_ray_driver_learns_as_ftrt_launch_does_and_resumes_from_its_checkpoint(tmp_path):
    ref = launched(tmp_path, 2, "steps=8", "checkpoint.url=null")
    metrics, ck = tmp_path / "ray.jsonl", tmp_path / "ck"
    common = ["--local-nodes", "2", *CONFIG, f"metrics_path={metrics}", f"checkpoint.url={ck}",
              "checkpoint.interval=2"]
    first = ray_cli(tmp_path, *common, "steps=5")  # stops after step 4, saved at 2, 4 and its end (5)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "world size 2" in first.stdout
    assert exact(lines(metrics)) == exact(ref[:5])
    second = ray_cli(tmp_path, *common, "steps=8")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resumed at step 5" in second.stdout, second.stdout
    assert exact(lines(metrics)) == exact(ref)  # bit for bit, across the driver's restart
    # bad input is named, without a traceback
    bad = ray_cli(tmp_path, "--local-nodes", "2", "rollout.mode=fleet", "checkpoint.url=null")
    assert bad.returncode == 2 and "rollout.mode" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    bad = ray_cli(tmp_path, "--remove-node-at", "3")
    assert bad.returncode == 2 and "--remove-node-at needs --local-nodes" in bad.stderr, bad.stderr


def test_a_node_lost_mid_update_costs_no_prompt_and_keeps_the_survivors(tmp_path):
    steps = 7
    ref = launched(tmp_path, 3, f"steps={steps}", "checkpoint.url=null")
    trace, metrics = tmp_path / "trace.jsonl", tmp_path / "ray.jsonl"
    cfg = load_config(None, [*CONFIG, f"steps={steps}", "checkpoint.url=null", f"metrics_path={metrics}"])
    env = {envnames.DIAG_HOLD: "grad_reduce:3", envnames.DIAG_TRACE: str(trace)}
    cluster = loopback_cluster(3)
    try:
        with ElasticGroup(WORKER, min_nodes=1, args=(cfg.model_dump(),), env=env) as group:
            before = {st["node_id"]: w["pid"] for st in group.status() for w in st["workers"]}
            got: dict = {}

            def drive() -> None:
                try:
                    got["summary"] = Driver(cfg, group).run()
                except Exception as exc:  # noqa: BLE001 - reported below
                    got["error"] = exc

            t = threading.Thread(target=drive)
            t.start()

            def held() -> int:
                marks = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
                return len({m["pid"] for m in marks if m["event"] == "held"})

            # every rank has computed its gradient of step 3 and holds before the all-reduce
            wait_until(lambda: held() == 3, 120, "every rank inside step 3's update")
            victim = sorted(before)[0]
            node = next(n for n in cluster.worker_nodes if f"ray-{n.node_id[:12]}" == victim)
            cluster.remove_node(node)
            t.join(300)
            assert not t.is_alive(), "the driver did not finish"
            assert "error" not in got, got.get("error")
            after = {st["node_id"]: w["pid"] for st in group.status() for w in st["workers"]}
            weights = group.call("weights").values
        assert after == {n: p for n, p in before.items() if n != victim}  # the survivors' processes kept
        assert weights[0] == weights[1]
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows = lines(metrics)
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["prompt_ids"] for r in rows] == [list(range(6 * s, 6 * s + 6)) for s in range(steps)]  # the ledger
    assert [r["world_size"] for r in rows] == [3, 3, 3, 2, 2, 2, 2]
    assert exact(rows[:3]) == exact(ref[:3])  # before the loss: bit-identical to the fault-free run
    for r, f in zip(rows[3:], ref[3:]):  # after it: the same prompts and samples, summed in another order
        assert r["reward_mean"] == pytest.approx(f["reward_mean"], rel=1e-6)
        assert r["loss"] == pytest.approx(f["loss"], rel=1e-4, abs=1e-6)
