"""A short learning smoke test: one process, a small task, the real trainer and checkpointer."""

from __future__ import annotations

import json
import subprocess
import sys


def test_grpo_learns_a_small_task_and_writes_its_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "ftrt.grpo", "seed=0", "steps=60", "prompts_per_step=16", "group_size=8",
         "task.params={length: 3, alphabet: 4}", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
         "lr=3e-3", f"metrics_path={metrics}", f"checkpoint.url={tmp_path / 'ck'}", "checkpoint.interval=20",
         "progress=none"],
        capture_output=True, text=True, timeout=240,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(60))
    for key in ("reward_mean", "loss", "kl", "world_size", "prompt_ids", "tokens_per_s", "time"):
        assert key in lines[0], key
    first = sum(x["reward_mean"] for x in lines[:10]) / 10
    last = sum(x["reward_mean"] for x in lines[-10:]) / 10
    assert last > first + 0.3, (first, last)
    assert "done: 60 steps" in res.stdout
    # Run again (the same training fields): it resumes from the final checkpoint and says it is finished.
    again = subprocess.run([sys.executable, "-m", "ftrt.grpo", "steps=60", "prompts_per_step=16", "group_size=8",
                            "task.params={length: 3, alphabet: 4}", "model.d_model=32", "model.n_layers=1",
                            "model.n_heads=2", "lr=3e-3", f"metrics_path={metrics}", f"checkpoint.url={tmp_path / 'ck'}",
                            "progress=none"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "resumed at step 60 of 60" in again.stdout, again.stdout + again.stderr
    assert "the run is already finished" in again.stdout, again.stdout
    assert len(metrics.read_text().splitlines()) == 60


def test_bad_config_exits_2_naming_the_field(tmp_path):
    res = subprocess.run([sys.executable, "-m", "ftrt.grpo", "group_size=1"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 2
    assert "'group_size' = 1" in res.stderr and "Traceback" not in res.stderr
