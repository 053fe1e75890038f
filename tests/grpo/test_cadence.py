"""The trainer's checkpoint cadence: ``auto`` saves often when failures are frequent, rarely when not."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from ftrt.checkpoint import Checkpointer
from ftrt.checkpoint.storage import list_steps, parse_url
from ftrt.grpo.checkpointing import Cadences
from ftrt.grpo.config import load_config
from ftrt.runtime import Runtime

TINY = ["steps=25", "prompts_per_step=4", "group_size=4", "model.d_model=16", "model.n_layers=1",
        "model.n_heads=2", "progress=none", "checkpoint.keep=1000"]


def train(tmp_path, name: str, *extra: str) -> tuple[list[int], list[int], str]:
    """Steps that were saved, steps after which a storage save was due, the trainer's output."""
    url = tmp_path / name
    res = subprocess.run([sys.executable, "-m", "ftrt.grpo", *TINY, f"checkpoint.url={url}",
                          f"metrics_path={tmp_path / name}.jsonl", *extra],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    due = [x["step"] + 1 for x in lines if x["ckpt"] == "storage"]
    return list_steps(parse_url(str(url), None)), due, res.stdout


def test_auto_storage_cadence_follows_the_mtbf(tmp_path):
    saved, due, _ = train(tmp_path, "frequent", "checkpoint.mtbf=0.001")
    # A failure every millisecond: a save is due after every step (one due while the last is still
    # being written is skipped, so that slow storage never stalls training).
    assert due == list(range(1, 26)), due
    assert saved[0] == 1 and saved[-1] == 25 and set(saved) <= set(due), saved
    # (The interval auto then announces needs the first save's cost, which arrives once that save is
    # persisted, at low CPU priority: on a busy machine after these 25 steps. What it announces is
    # checked on agreed numbers in the test below.)
    saved, due, _ = train(tmp_path, "rare", "checkpoint.mtbf=1e9", "checkpoint.max_interval_s=1e6")
    assert saved == due == [1, 25], (saved, due)  # the first save measures the cost; the last always goes
    saved, due, _ = train(tmp_path, "fixed", "checkpoint.interval=10")
    assert due == [10, 20, 25] and set(saved) <= set(due) and saved[-1] == 25, (saved, due)


def test_the_save_after_a_step_follows_the_cadences_the_last_step_and_a_round_end():
    from ftrt.grpo.checkpointing import decide_save

    def decide(done, **kw):
        args = dict(checkpointing=True, round_ends=False, storage_due=False, memory_due=False) | kw
        d = decide_save(done, 10, **args)
        return d.tier, d.skip_if_busy

    assert decide(3) == (None, True)
    assert decide(3, memory_due=True) == ("memory", True)
    assert decide(3, storage_due=True, memory_due=True) == ("storage", True)
    assert decide(10) == ("storage", False)  # the final save: always to storage, never skipped
    # A round that ends after this step ends with a memory save, never skipped: the next round has it.
    assert decide(4, round_ends=True, storage_due=True) == ("memory", False)
    # When the next round is inactive (the job waits or stops), that save goes to storage.
    assert decide(4, round_ends=True, durable=True) == ("storage", False)
    assert decide(10, checkpointing=False, storage_due=True, memory_due=True) == (None, False)


def test_behind_a_memory_tier_on_two_nodes_storage_plans_for_losses_of_memory_not_for_faults(tmp_path, capsys):
    def choices(rt: Runtime, *overrides: str, resumed_from: str | None = None) -> str:
        """The cadences' announcements after one agreed update: 5 ms memory saves, 50 ms storage ones."""
        cfg = load_config(None, list(overrides))
        with Checkpointer(str(tmp_path / "ck"), mem_dir=str(tmp_path / "mem")) as ck:
            cadences = Cadences(rt, cfg, ck, announce=True, nodes=rt.world_size // rt.local_world_size)
            if resumed_from:
                cadences.resumed(3, resumed_from)
            world = rt.world_size
            cadences.update([0.4 * world, 100.0 * world, 0.005 * world, world, 0.05 * world, world], world,
                            restores=0)
        return capsys.readouterr().out

    def interval(out: str, tier: str) -> float:
        line = next(x for x in out.splitlines() if f"] {tier} checkpoints every" in x)
        return float(line.split(" every ")[1].split(" s ")[0])

    # A fault a minute on 2 nodes: memory plans for it; a lost node is recovered from memory, so
    # storage plans for losing every memory copy (none seen yet: the prior hour).
    two_nodes = Runtime(world_size=2, local_world_size=1, faults=4, mtbf=60.0, job_started=time.time() - 100)
    out = choices(two_nodes)
    assert interval(out, "memory") == pytest.approx(math.sqrt(2 * 0.005 * 60) - 0.005, abs=0.01), out
    assert interval(out, "storage") == pytest.approx(math.sqrt(2 * 0.05 * 3600) - 0.05, abs=0.01), out
    assert "MTBF 3600 s (prior: no loss of memory checkpoints yet in 100 s)" in out
    # Configured, that MTBF is used.
    assert interval(choices(two_nodes, "checkpoint.storage_mtbf=600"), "storage") == pytest.approx(
        math.sqrt(2 * 0.05 * 600) - 0.05, abs=0.01)
    # A round that had to restore from storage after a fault: memory did not recover it, so storage
    # plans for every fault again; a restore from memory changes nothing.
    every_fault = math.sqrt(2 * 0.05 * 60) - 0.05
    assert interval(choices(two_nodes, resumed_from="storage"), "storage") == pytest.approx(every_fault, abs=0.01)
    assert interval(choices(two_nodes, resumed_from="memory"), "storage") == pytest.approx(
        math.sqrt(2 * 0.05 * 3600) - 0.05, abs=0.01)
    # One node holds every copy (its loss is the job's), and without memory checkpoints there is no
    # tier in front: storage plans for every fault.
    one_node = Runtime(world_size=2, local_world_size=2, faults=4, mtbf=60.0, job_started=time.time() - 100)
    assert interval(choices(one_node), "storage") == pytest.approx(every_fault, abs=0.01)
    assert interval(choices(two_nodes, "checkpoint.memory_interval=0"), "storage") == pytest.approx(every_fault, abs=0.01)


def test_in_place_with_the_whole_state_on_every_rank_memory_plans_for_what_the_live_ranks_do_not_recover(
        tmp_path, capsys):
    class InPlace(Runtime):
        in_place = True  # what ftrt launch --recovery in-place makes true once the group is up

    def memory_interval(rt: Runtime, *overrides: str, nodes: int = 2, restores: int = 0) -> tuple[float, str]:
        cfg = load_config(None, list(overrides))
        with Checkpointer(str(tmp_path / "ck"), mem_dir=str(tmp_path / "mem")) as ck:
            cadences = Cadences(rt, cfg, ck, announce=True, nodes=nodes)
            world = rt.world_size
            cadences.update([0.4 * world, 600.0 * world, 0.005 * world, world, 0.05 * world, world], world,
                            restores=restores)
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if "] memory checkpoints every" in x)
        return float(line.split(" every ")[1].split(" s ")[0]), line

    kw = dict(world_size=2, local_world_size=1, faults=4, mtbf=60.0, job_started=time.time() - 600)
    rare = math.sqrt(2 * 0.005 * 3600) - 0.005
    every_fault = math.sqrt(2 * 0.005 * 60) - 0.005
    seconds, line = memory_interval(InPlace(**kw))
    assert seconds == pytest.approx(rare, abs=0.01), line
    assert "prior: no fault the live ranks did not recover yet in 600 s" in line
    # What the survivors did not recover shows in the trainer's restores: it plans for their rate.
    seconds, line = memory_interval(InPlace(**kw), restores=2)
    assert seconds == pytest.approx(math.sqrt(2 * 0.005 * 300) - 0.005, abs=0.01), line
    assert "observed: 2 faults the live ranks did not recover in 600 s" in line
    # Where they cannot recover a fault without a checkpoint, memory plans for every fault again: a
    # rank alone, a step of several optimizer passes (a fault between two leaves no rank with a
    # whole step), the rollout fleet (samples ahead are lost with rank 0), a round whose node
    # loss would take the job below --nnodes MIN (it goes inactive and restores), and --recovery
    # restart. On one node (several ranks) a node's loss is the job's, which only storage recovers.
    assert memory_interval(InPlace(**{**kw, "world_size": 1}), nodes=1)[0] == pytest.approx(every_fault, abs=0.01)
    assert memory_interval(InPlace(**kw), "ppo_epochs=2")[0] == pytest.approx(every_fault, abs=0.01)
    assert memory_interval(InPlace(**kw), "rollout.mode=fleet")[0] == pytest.approx(every_fault, abs=0.01)
    assert memory_interval(InPlace(**kw, min_nodes=2))[0] == pytest.approx(every_fault, abs=0.01)
    assert memory_interval(InPlace(**kw, min_nodes=2), nodes=3)[0] == pytest.approx(rare, abs=0.01)
    assert memory_interval(Runtime(**kw))[0] == pytest.approx(every_fault, abs=0.01)
    assert memory_interval(InPlace(**{**kw, "local_world_size": 2}), nodes=1)[0] == pytest.approx(rare, abs=0.01)
