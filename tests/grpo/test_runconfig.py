"""A second GRPO run on the same checkpoints: a finished run says so, another configuration is
refused naming what differs, ``resume=force`` goes on (``ftrt.grpo.runconfig``); real runs, real files."""

from __future__ import annotations

import json
import subprocess
import sys

from ftrt.grpo.config import load_config
from ftrt.grpo.runconfig import FILE, differences, training_fields


def _grpo(cwd, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrt.grpo", "progress=none", "prompts_per_step=4", "group_size=4",
                           *overrides], cwd=cwd, capture_output=True, text=True, timeout=240)


def test_only_what_changes_the_training_counts_as_another_configuration():
    base = training_fields(load_config(None, []))
    same = training_fields(load_config(None, ["steps=9", "checkpoint.url=/elsewhere", "metrics_path=m.jsonl",
                                              "threads=2", "resume=force", "rollout.request_timeout=5"]))
    assert differences(base, same) == []
    other = training_fields(load_config(None, ["lr=0.01", "seed=3"]))
    assert differences(base, other) == ["lr: 0.001 in the checkpoints, 0.01 now", "seed: 0 in the checkpoints, 3 now"]


def test_a_second_run_in_the_same_folder_says_finished_refuses_another_config_and_is_forced_on(tmp_path):
    first = _grpo(tmp_path, "steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((tmp_path / "grpo-checkpoints" / FILE).read_text())["fields"]["lr"] == 0.001

    again = _grpo(tmp_path, "steps=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run is already finished: its checkpoint at grpo-checkpoints is at step 2 of steps=2" in again.stdout

    other = _grpo(tmp_path, "steps=3", "lr=0.01")
    assert other.returncode != 0 and "Traceback" not in other.stderr
    assert "holds a run with another configuration, which this run would resume: lr: 0.001 in the checkpoints, " \
           "0.01 now" in other.stderr, other.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "grpo-metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]  # the refused run trained nothing

    forced = _grpo(tmp_path, "steps=3", "lr=0.01", "resume=force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "resume=force: going on from checkpoints written with another configuration: lr:" in forced.stdout
    assert "resumed at step 2 of 3" in forced.stdout
    assert json.loads((tmp_path / "grpo-checkpoints" / FILE).read_text())["fields"]["lr"] == 0.01  # now this run's
