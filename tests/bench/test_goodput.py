"""The goodput and overhead benchmarks' arithmetic, on synthetic step timelines."""

from __future__ import annotations

import pytest

from bench.goodput import _longest_gap, _switch_stall, summarize
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


def test_a_switch_stall_is_the_gap_at_the_new_world_less_its_first_step():
    lines = [{"world_size": w, "step_s": 0.5} for w in (3, 3, 2, 2, 2, 3, 3)]
    ends = [1.0, 1.5, 3.0, 3.5, 4.0, 5.2, 5.7]
    assert _switch_stall(lines, ends, 1.6, 4.5, grows=False) == pytest.approx(1.0)  # 1.5 -> 3.0, a 0.5 s step
    assert _switch_stall(lines, ends, 3.8, 9.0, grows=True) == pytest.approx(0.7)  # 4.0 -> 5.2 at world 3
    assert _switch_stall(lines, ends, 1.6, 3.2, grows=True) is None  # no larger world in the window


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


def test_fault_intervals_parse_and_each_gets_room_for_one_fault():
    import argparse

    from bench.goodput import duration_for, parse_every

    assert parse_every("60,600,none") == [60.0, 600.0, None]
    with pytest.raises(argparse.ArgumentTypeError, match="'often'"):
        parse_every("60,often")
    assert duration_for(60.0, 300, 10) == 300
    assert duration_for(600.0, 300, 10) == 700  # one kill at 600 s, back at 610, 90 s after
    assert duration_for(None, 300, 10) == 300


def test_series_compares_steps_trained_in_the_same_wall_time():
    from bench.goodput import render_series, series

    rows = [{"system": "ftrt", "every": 60.0, "steps": 500, "goodput": 0.97, "wall_s": 300},
            {"system": "torchrun", "every": 60.0, "steps": 400, "goodput": 0.72, "wall_s": 300},
            {"system": "ftrt", "every": None, "steps": 600, "goodput": 0.99, "wall_s": 300},
            {"system": "torchrun", "every": None, "steps": 610, "goodput": 0.99, "wall_s": 300}]
    s = series(rows)
    assert [e["every"] for e in s] == [60.0, None]
    assert s[0]["steps_ratio"] == 1.25 and s[1]["steps_ratio"] == pytest.approx(600 / 610, abs=1e-4)
    table = render_series(s)
    assert "none" in table and "1.250" in table and "60 s" in table


def test_repeats_alternate_the_order_and_sum_the_steps_of_each_system():
    from bench.goodput import render_series, run_order, series

    assert run_order(["ftrt", "torchrun"], 3) == [(0, "ftrt"), (0, "torchrun"), (1, "torchrun"), (1, "ftrt"),
                                                   (2, "ftrt"), (2, "torchrun")]
    rows = [{"system": "ftrt", "every": 600.0, "rep": 0, "steps": 1100, "goodput": 0.99, "wall_s": 700},
            {"system": "torchrun", "every": 600.0, "rep": 0, "steps": 1000, "goodput": 0.96, "wall_s": 700},
            {"system": "torchrun", "every": 600.0, "rep": 1, "steps": 1200, "goodput": 0.96, "wall_s": 700},
            {"system": "ftrt", "every": 600.0, "rep": 1, "steps": 1100, "goodput": 0.98, "wall_s": 700}]
    (e,) = series(rows)
    assert e["steps_ratio"] == 1.0 and e["pair_ratios"] == [1.1, pytest.approx(1100 / 1200, abs=1e-4)]
    assert e["ftrt_steps"] == 1100 and e["torchrun_steps"] == 1100 and e["ftrt_goodput"] == 0.985
    assert "(1.100, 0.917)" in render_series([e])


def test_overhead_breakdown_charges_each_component_by_its_own_pairs():
    from bench.overhead import components

    rows = [{"system": "ftrt", "rep": 0, "step_s": 0.210}, {"system": "ftrt-nohb", "rep": 0, "step_s": 0.200},
            {"system": "ftrt", "rep": 1, "step_s": 0.220}, {"system": "ftrt-nohb", "rep": 1, "step_s": 0.220},
            {"system": "ftrt-mem1", "rep": 0, "step_s": 0.3}]
    c = components(rows, ["ftrt", "ftrt-nohb", "ftrt-mem1", "ftrt-nomem"])
    assert list(c) == ["ftrt-nohb"]  # ftrt-nomem did not run
    assert c["ftrt-nohb"]["pair_ratios"] == [1.05, 1.0] and c["ftrt-nohb"]["component"] == "heartbeats"


def test_series_gives_every_ftrt_system_s_ratio_to_every_baseline():
    from bench.goodput import render_series, series

    rows = [{"system": s, "every": 60.0, "steps": n, "goodput": g, "wall_s": 300, "rep": 0}
            for s, n, g in (("ftrt", 760, 0.98), ("ftrt-inplace", 800, 0.99), ("torchrun", 600, 0.76),
                            ("torchft", 640, 0.95))]
    (e,) = series(rows)
    assert e["ratios"] == {"ftrt/torchrun": pytest.approx(760 / 600, abs=1e-4), "ftrt/torchft": 1.1875,
                           "ftrt-inplace/torchrun": pytest.approx(800 / 600, abs=1e-4), "ftrt-inplace/torchft": 1.25}
    assert e["steps_ratio"] == e["ratios"]["ftrt/torchrun"] and e["torchft_steps"] == 640
    table = render_series([e])
    assert "ftrt-inplace/torchft" in table and "1.250" in table and "99.0%" in table
