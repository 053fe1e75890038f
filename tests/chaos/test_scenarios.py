"""The chaos suite: scenario validation, and scenarios run end to end on real processes.

A quick subset runs by default; every built-in scenario runs under ``pytest -m chaos`` (each one
also exercises its fault injector against the real cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftrt.chaos.scenario import builtin, builtin_dir, load_scenario
from ftrt.errors import ConfigError

QUICK = ("kill-node", "corrupt-checkpoint")


def test_every_builtin_scenario_is_valid_and_covers_every_fault_kind():
    from typing import get_args

    from ftrt.chaos.scenario import FaultKind

    found = builtin()
    assert len(found) >= 9
    kinds = {f.kind for _, sc in found for f in sc.faults}
    assert kinds == set(get_args(FaultKind)), set(get_args(FaultKind)) - kinds


@pytest.mark.parametrize("body, message", [
    ("name: x\ndescription: y\nfaults: [{kind: kill_node}]\n", "give exactly one of at_step and at_s"),
    ("name: x\ndescription: y\nfaults: [{kind: explode, at_step: 1}]\n", "faults.0.kind"),
    ("name: x\ndescription: y\nfaults: [{kind: freeze_node, at_step: 1}]\n", "needs duration_s"),
    ("name: x\ndescription: y\nfaults: [{kind: kill_node, at_step: 1, target: node9}]\n", "node9"),
    ("name: x\ndescription: y\nfaults: [{kind: kill_etcd_member, at_step: 1, duration_s: 2}]\n",
     "needs cluster.etcd_members: 3"),
    ("name: x\ndescription: y\nsteps: 10\nfaults: [{kind: kill_node, at_step: 10}]\n", "not before the last step"),
    ("name: x\ndescription: y\ncluster: {nodes: 0}\n", "cluster.nodes"),
    ("name: x\ndescription: y\nsurprise: 1\n", "unknown field 'surprise'"),
    ("- just\n- a list\n", "must be a mapping"),
])
def test_invalid_scenarios_are_rejected_naming_the_field(tmp_path, body, message):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_scenario(f)
    assert message in str(err.value) and "bad.yaml" in str(err.value)


def test_chaos_list_names_every_builtin_scenario():
    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "chaos", "list"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    for path in builtin_dir().glob("*.yaml"):
        assert path.stem in res.stdout


def run_scenario(name: str, report: Path) -> tuple[subprocess.CompletedProcess, dict]:
    res = subprocess.run(
        [sys.executable, "-m", "ftrt.cli.main", "chaos", "run", str(builtin_dir() / f"{name}.yaml"),
         "--report", str(report)], capture_output=True, text=True, timeout=600)
    data = json.loads((report / "report.json").read_text()) if (report / "report.json").exists() else {}
    return res, data


def check(res: subprocess.CompletedProcess, data: dict, name: str) -> None:
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert data["passed"] is True and data["scenario"] == name
    assert all(v["ok"] for v in data["invariants"].values()), data["invariants"]
    assert data["faults"] and all(f["recovery_s"] is not None for f in data["faults"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", QUICK)
def test_quick_scenarios_pass(tmp_path, name):
    res, data = run_scenario(name, tmp_path / name)
    check(res, data, name)
    assert (tmp_path / name / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "| invariant | holds | why |" in (tmp_path / name / "report.md").read_text()


@pytest.mark.chaos
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(p.stem for p in builtin_dir().glob("*.yaml") if p.stem not in QUICK))
def test_builtin_scenario_passes(tmp_path, name):
    res, data = run_scenario(name, tmp_path / name)
    check(res, data, name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_broken_invariant_fails_the_run_with_a_reason(tmp_path):
    """A scenario whose recovery limit cannot be met must fail, naming the invariant."""
    f = tmp_path / "strict.yaml"
    sc = (builtin_dir() / "kill-node.yaml").read_text().replace("max_recovery_s: 15", "max_recovery_s: 0.001")
    f.write_text(sc)
    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "chaos", "run", str(f), "--report",
                          str(tmp_path / "r")], capture_output=True, text=True, timeout=600)
    assert res.returncode != 0
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["passed"] is False and data["invariants"]["recovered"]["ok"] is False
    assert "limit 0.001 s" in data["invariants"]["recovered"]["reason"]
