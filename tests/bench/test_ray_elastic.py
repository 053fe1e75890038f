"""The Ray benchmark's arithmetic, on synthetic step logs: progress counts the highest step reached
(steps trained again after a rollback are not progress), recovery runs from a removal to the next step."""

from __future__ import annotations

import pytest

from bench.ray_elastic import summarize


def test_progress_ignores_steps_trained_again_and_stalls_run_from_the_loss_and_from_the_return():
    # steps 0..29 every 0.1 s from t=100; a removal at t=103.05; nothing until t=110, when the run
    # rolls back to step 20 (its checkpoint) and trains 20..49 every 0.1 s
    lines = [{"step": i, "t": 100.0 + 0.1 * (i + 1), "world": 3} for i in range(30)]
    lines += [{"step": 20 + i, "t": 110.0 + 0.1 * i, "world": 2} for i in range(30)]
    run = {"t0": 100.35, "faults": [103.05], "adds": [115.0], "steps": lines}
    r = summarize("raytrain", run, duration=20.0)
    assert r["progress_steps"] == 49 - 2  # reached step 49; step 2 was done before the window
    assert r["steps_logged"] == 57  # every line in the window, the redone ones too
    assert r["fault_free_step_s"] == pytest.approx(0.1)
    assert r["stall_after_loss_s"] == [pytest.approx(110.0 - 103.05)]  # from the removal to the next step
    assert r["stall_after_return_s"] == [pytest.approx(120.35 - 115.0)]  # no step after the return (t=115)
    assert r["goodput"] == pytest.approx(47 * 0.1 / 20.0, abs=1e-3)
    assert r["worlds"] == [2, 3]


def test_a_fault_never_recovered_from_stalls_to_the_window_s_end():
    lines = [{"step": i, "t": 10.0 + i, "world": 2} for i in range(5)]
    r = summarize("ftrt", {"t0": 12.0, "faults": [14.5], "adds": [], "steps": lines}, duration=10.0)
    assert r["stall_after_loss_s"] == [pytest.approx(22.0 - 14.5)] and r["stall_after_return_s"] == []
    assert r["progress_steps"] == 4 - 1
