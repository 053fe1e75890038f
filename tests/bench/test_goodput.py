"""The goodput and overhead benchmarks' arithmetic, on synthetic step timelines."""

from __future__ import annotations

import pytest

from bench.goodput import _longest_gap, summarize
from bench.overhead import summarize as overhead_summary


def _lines(ends: list[float], step_s: float = 0.5, t0: float = 1000.0) -> list[dict]:
    return [{"step": i, "time": t0 + t, "step_s": step_s, "world_size": 3, "redone": 0, "resumes": 0}
            for i, t in enumerate(ends)]


def test_goodput_counts_only_the_steps_that_stand_and_charges_the_stall_to_the_fault():
    # steps every 0.5 s for 10 s, a kill at 10 s, nothing until 14 s, then steps again to 20 s
    ends = [0.5 * i for i in range(1, 21)] + [14 + 0.5 * i for i in range(0, 13)]
    faults = [{"node": "n1", "killed_at": 10.0, "restarted_at": 12.0}]
    r = summarize("ftrt", _lines(ends), faults, 1000.0, 20.0, 10)
    assert r["steps"] == 33
    assert r["goodput"] == pytest.approx(33 * 0.5 / 20.0)
    assert r["faults"][0]["pause_after_kill_s"] == pytest.approx(2.0)  # 10 -> 12 with no step
    assert r["faults"][0]["pause_after_rejoin_s"] == pytest.approx(2.0)  # 12 -> 14
    assert r["median_step_s"] == 0.5


def test_longest_gap_runs_from_the_fault_to_the_end_of_its_window():
    assert _longest_gap([1.0, 2.0, 6.0, 7.0], 2.5, 8.0) == pytest.approx(3.5)
    assert _longest_gap([1.0, 2.0, 3.0, 3.5], 2.5, 8.0) == pytest.approx(4.5)  # stalled after two steps
    assert _longest_gap([1.0, 2.0], 2.5, 8.0) == pytest.approx(5.5)  # never stepped again


def test_overhead_ratio_is_against_torchrun_run_by_run():
    rows = [{"system": "torchrun", "rep": 0, "step_s": 0.20}, {"system": "ftrt", "rep": 0, "step_s": 0.21},
            {"system": "ftrt", "rep": 1, "step_s": 0.19}, {"system": "torchrun", "rep": 1, "step_s": 0.20}]
    s = overhead_summary(rows, ["torchrun", "ftrt"])
    assert s["ftrt"]["pair_ratios"] == [1.05, 0.95]
    assert s["ftrt"]["ratio"] == pytest.approx(1.0)


def test_overhead_verdict_follows_the_interval_of_the_median_pair():
    from bench.overhead import median_interval, verdict

    lo, hi = median_interval([1.00, 1.01, 1.01, 1.00, 1.015])
    assert 1.0 <= lo <= hi <= 1.015 and "met" in verdict(lo, hi) and "not" not in verdict(lo, hi)
    lo, hi = median_interval([1.05, 1.04, 1.06, 1.03, 1.05])
    assert lo > 1.02 and verdict(lo, hi).startswith("not met")
    lo, hi = median_interval([0.99, 1.07, 1.01, 1.04, 1.02])
    assert lo <= 1.02 < hi and verdict(lo, hi).startswith("not settled")
