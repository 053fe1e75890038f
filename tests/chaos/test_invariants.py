"""The chaos invariants, each judged on small hand-made inputs: one case that holds, one that does not."""

from __future__ import annotations

from ftrt.chaos import invariants as inv
from ftrt.chaos.invariants import CheckpointScan
from ftrt.chaos.runner import FaultRecord, JobResult
from ftrt.chaos.scenario import Scenario

PER = 2  # prompts per step in these inputs


def line(step: int, world: int = 2, prompts: list[int] | None = None, **fields) -> dict:
    ids = list(range(step * PER, (step + 1) * PER)) if prompts is None else prompts
    return {"step": step, "reward_mean": 0.5, "loss": 0.1, "kl": 0.0, "grad_norm": 0.3, "world_size": world,
            "prompt_ids": ids, **fields}


def scenario(**expect) -> Scenario:
    return Scenario(name="x", description="y", steps=3, job={"grpo": {"prompts_per_step": PER}},
                    expect={"max_recovery_s": 5, **expect})


def fault(recovery_s: float | None, *, kind: str = "kill_node", warm: bool = True, limit_s: float | None = None,
          detail: str = "killed") -> FaultRecord:
    return FaultRecord(kind, "node1", at=1.0, step=2, detail=detail, recovery_s=recovery_s, spares_warm=warm,
                       limit_s=limit_s)


def test_final_step_needs_every_step_once_and_every_agent_to_exit_0():
    lines = [line(0), line(1), line(2)]
    assert inv.final_step(3, lines, {"node0": 0, "node1": 0}) == (
        True, "steps 0..2 trained once each, agents exited {'node0': 0, 'node1': 0}")
    ok, reason = inv.final_step(3, lines, {"node0": 0, "node1": 1})
    assert not ok and "agents exited {'node0': 0, 'node1': 1}" in reason
    assert inv.final_step(3, [line(0), line(1), line(1)], {"node0": 0}) == (
        False, "trained steps 0..1 (3 lines, 2 distinct) of 0..2; agents exited {'node0': 0}")
    assert inv.final_step(3, [], {}) == (False, "trained steps none of 0..2; agents exited {}")


def test_recovered_judges_each_fault_against_its_limit():
    sc = scenario()
    assert inv.recovered(sc, [fault(1.5, limit_s=5)]) == (
        True, "1/1 faults injected; slowest recovery 1.50 s (limit 5.0 s)")
    assert inv.recovered(sc, [fault(6.0, limit_s=5)]) == (
        False, "1/1 faults injected; slowest recovery 6.00 s (limit 5.0 s); late: ['kill_node']")
    # A cold fault is judged against the cold limit, and the reason says so.
    assert inv.recovered(sc, [fault(12.0, warm=False, limit_s=30.0)]) == (
        True, "1/1 faults injected; slowest recovery 12.00 s (limit 5.0 s; 1 cold, limit 30.0 s)")
    # A fault that never stalled training (no step after it) or was not injected fails it.
    assert not inv.recovered(sc, [fault(None)])[0]
    ok, reason = inv.recovered(sc, [fault(1.0), fault(None, detail="not injected: the job ended before it was due")])
    assert not ok and reason.startswith("1/2 faults injected")
    strict = Scenario(name="x", description="y", expect={"max_recovery_s": 0.001})
    ok, reason = inv.recovered(strict, [fault(0.4)])
    assert not ok and "limit 0.001 s" in reason


def test_a_cold_fault_has_its_own_recovery_limit():
    assert inv.recovery_limit(scenario(), True) == 5 and inv.recovery_limit(scenario(), False) == 30
    assert inv.recovery_limit(scenario(max_recovery_s=45), False) == 45
    assert inv.recovery_limit(scenario(max_cold_recovery_s=8), False) == 8


def test_checkpoints_verify_except_those_damaged_on_purpose():
    url = "/ck"
    assert inv.checkpoints_verify(CheckpointScan(url, {5: None, 10: None})) == (True, "2 committed checkpoints verify")
    assert inv.checkpoints_verify(CheckpointScan(url, {5: None, 10: "bad hash"}, frozenset({10}))) == (
        True, "1 committed checkpoints verify; 1 damaged on purpose fail as they must")
    assert inv.checkpoints_verify(CheckpointScan(url, {5: None, 10: "bad hash"})) == (False, "step 10: bad hash")
    assert inv.checkpoints_verify(CheckpointScan(url, {5: None}, frozenset({5}))) == (
        False, "step 5 was damaged but verifies")
    assert inv.checkpoints_verify(CheckpointScan(url)) == (False, "no committed checkpoint at /ck")
    assert inv.checkpoints_verify(CheckpointScan(url, listing_error="access denied")) == (
        False, "cannot list the checkpoints at /ck: access denied")
    assert inv.checkpoints_verify(None) == (False, "not checked")


def test_the_ledger_has_no_gap_and_no_repeat():
    assert inv.ledger([line(0), line(1, prompts=[3, 2])], PER) == (True, "4 prompts, 0 repeated, 0 missing")
    assert inv.ledger([line(0), line(1, prompts=[1, 2])], PER) == (False, "4 prompts, 1 repeated, 1 missing")
    assert inv.ledger([line(0), line(1, prompts=[2])], PER) == (False, "3 prompts, 0 repeated, 1 missing")


def test_exact_equivalence_compares_every_step_bit_for_bit():
    ref = [line(0), line(1), line(2)]
    assert inv.same_metrics([line(0), line(1, time=9.0), line(2)], ref) == (
        True, "every step's reward, loss, kl, gradient norm and prompts equal the fault-free run's")
    assert inv.same_metrics([line(0), {**line(1), "loss": 0.1 + 1e-16 + 1e-17}, line(2)], ref) == (
        False, "steps [1] differ from the fault-free run")
    assert inv.same_metrics([line(0), line(1), {**line(2), "grad_norm": 0.3 + 1e-16}], ref) == (
        False, "steps [2] differ from the fault-free run")  # a step's update differs, not its loss
    ok, _ = inv.same_metrics([line(0), line(1)], ref)  # a step missing
    assert not ok


def test_ledger_equivalence_wants_each_step_to_train_the_fault_free_prompts():
    assert inv.same_prompts([line(0), line(1, world=1)], PER) == (True, "each step trained the fault-free run's prompts")
    assert inv.same_prompts([line(0), line(1, prompts=[3, 2])], PER) == (False, "steps [1] trained other prompts")


def test_the_world_must_grow_again_after_its_smallest():
    lines = [line(0, 3), line(1, 2), line(2, 2), line(3, 3)]
    assert inv.world_sizes(lines) == [3, 2, 3]
    assert inv.world_grows([3, 2, 3]) == (True, "world sizes 3 -> 2 -> 3: it grew again after its smallest")
    assert inv.world_grows([3, 2]) == (False, "world sizes 3 -> 2: it never grew after its smallest")
    assert inv.world_grows([]) == (False, "world sizes : it never grew after its smallest")


def test_the_agents_recovery_metric_agrees_with_the_steps():
    one = [fault(4.0)]
    assert inv.metrics_agree(one, {"node0": {"recovery_sum_s": 4.6, "recovery_count": 1}}) == (
        True, "ftrt_recovery_seconds on node0 4.60 s against 4.00 s measured from the steps (allowed: 0.5 s + 25 %)")
    ok, _ = inv.metrics_agree(one, {"node0": {"recovery_sum_s": 4.2, "recovery_count": 1},
                                    "node2": {"recovery_sum_s": 9.0, "recovery_count": 1}})
    assert not ok
    ok, reason = inv.metrics_agree(one, {"node0": {"recovery_sum_s": 0.0, "recovery_count": 0}})
    assert not ok and reason.startswith("no agent's ftrt_recovery_seconds observed the kill_node")
    # Nothing to compare: two faults, a kind agents do not see at once, or no agent scraped.
    assert inv.metrics_agree([fault(4.0), fault(3.0)], {"node0": {"recovery_sum_s": 4, "recovery_count": 1}}) is None
    assert inv.metrics_agree([fault(4.0, kind="freeze_node")], {"node0": {"recovery_sum_s": 4, "recovery_count": 1}}) is None
    assert inv.metrics_agree(one, {}) is None


def test_no_process_and_no_leased_key_may_be_left():
    assert inv.no_process_left([]) == (True, "no process of the run is alive")
    assert inv.no_process_left([41, 42]) == (False, "still alive: [41, 42]")
    assert inv.no_stale_keys([]) == (True, "no leased key left under the job's prefix")
    assert inv.no_stale_keys(["/ftrt/j/nodes/node1"]) == (False, "leased keys left: ['/ftrt/j/nodes/node1']")


def test_judge_applies_the_invariants_the_scenario_asks_for_in_the_reports_order():
    lines = [line(0), line(1), line(2)]
    job = JobResult(lines=lines, records=[fault(1.0, limit_s=5)], codes={"node0": 0},
                    checkpoints=CheckpointScan("/ck", {3: None}))
    got = inv.judge(scenario(equivalence="exact"), job, lines, alive=[])
    assert list(got) == ["final_step", "recovered", "checkpoints_verify", "ledger", "equivalence", "no_process_left",
                         "no_stale_keys"]
    assert all(v["ok"] for v in got.values())
    got = inv.judge(scenario(equivalence="none", world_grows=True), job, None, alive=[7])
    assert "equivalence" not in got and got["world_grows"]["ok"] is False
    assert got["no_process_left"] == {"ok": False, "reason": "still alive: [7]"}


def test_planned_departures_alone_must_redo_nothing():
    lines = [line(0), line(1), line(2, redone=0)]
    job = JobResult(lines=lines, records=[fault(0.3, kind="drain_node", limit_s=5),
                                          fault(0.4, kind="preempt_node", limit_s=5)], codes={"node0": 0},
                    checkpoints=CheckpointScan("/ck", {}))
    got = inv.judge(scenario(), job, None, alive=[])
    assert got["nothing_redone"] == {"ok": True, "reason": "no step was redone"}
    job.lines = [line(0), line(1), line(2, redone=2)]
    assert inv.judge(scenario(), job, None, alive=[])["nothing_redone"] == {
        "ok": False, "reason": "2 step(s) were trained again"}
    job.records.append(fault(0.5, kind="kill_node", limit_s=5))  # a crash may redo a step: not judged then
    assert "nothing_redone" not in inv.judge(scenario(), job, None, alive=[])
