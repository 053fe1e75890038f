"""Checkpoint cadence: the Young/Daly interval, the MTBF estimate and the per-step schedule (pure)."""

from __future__ import annotations

import math

import pytest

from ftrt.checkpoint.cadence import (
    MEMORY_LOSS,
    PRIOR_MTBF_S,
    Cadence,
    MtbfEstimate,
    choose_interval,
    estimate_mtbf,
    young_daly_interval,
)
from ftrt.errors import ConfigError


def test_young_daly_is_sqrt_2cm_minus_c_and_m_when_saves_outlast_failures():
    assert young_daly_interval(0.01, 3600) == pytest.approx(math.sqrt(72) - 0.01)
    assert young_daly_interval(0.5, 60) == pytest.approx(math.sqrt(60) - 0.5)
    assert young_daly_interval(0.0, 60) == 0.0  # free saves: save every step
    assert young_daly_interval(300, 100) == 100  # C >= 2M: the formula no longer applies
    # Never longer than the MTBF, whatever the cost (the cadence's bound before one is measured).
    assert max(young_daly_interval(c / 100, 60) for c in range(0, 20000)) <= 60
    # Lower cost or more frequent failures: shorter intervals.
    assert young_daly_interval(0.01, 60) < young_daly_interval(0.01, 600) < young_daly_interval(0.1, 600)
    with pytest.raises(ValueError):
        young_daly_interval(0.01, 0)


def test_mtbf_is_configured_else_observed_else_the_prior():
    assert estimate_mtbf(120.0, faults=9, elapsed_s=10) == MtbfEstimate(120.0, "configured")
    assert estimate_mtbf(None, faults=3, elapsed_s=600).seconds == 200
    assert "3 faults in 600 s" in estimate_mtbf(None, faults=3, elapsed_s=600).source
    assert "1 fault in 600 s" in estimate_mtbf(None, faults=1, elapsed_s=600).source
    # What the faults are is named, e.g. the storage tier's behind a memory tier.
    lost = estimate_mtbf(None, faults=2, elapsed_s=600, counted=MEMORY_LOSS)
    assert lost.seconds == 300 and lost.source == "observed: 2 losses of memory checkpoints in 600 s"
    assert estimate_mtbf(None, 0, 10, counted=MEMORY_LOSS).source == "prior: no loss of memory checkpoints yet in 10 s"
    early = estimate_mtbf(None, faults=0, elapsed_s=10)
    assert early.seconds == PRIOR_MTBF_S and early.source.startswith("prior")
    assert estimate_mtbf(None, faults=0, elapsed_s=3 * PRIOR_MTBF_S).seconds == 3 * PRIOR_MTBF_S
    with pytest.raises(ConfigError, match="positive number of seconds"):
        estimate_mtbf(-1.0, 0, 0)


def test_choice_is_capped_and_names_its_numbers():
    c = choose_interval(0.02, MtbfEstimate(60.0, "configured"), max_interval_s=300)
    assert c.seconds == pytest.approx(math.sqrt(2.4) - 0.02)
    assert "save cost 20.0 ms" in c.reason and "MTBF 60 s (configured)" in c.reason
    capped = choose_interval(5.0, MtbfEstimate(1e6, "configured"), max_interval_s=300)
    assert capped.seconds == 300 and "capped at 300 s" in capped.reason


def fixed(mtbf: float):
    return lambda faults, elapsed: MtbfEstimate(mtbf, "configured")


def test_a_fixed_interval_saves_every_n_steps_and_zero_never():
    every3 = Cadence("memory", 3, max_interval_s=10, mtbf=fixed(60))
    assert [s for s in range(1, 13) if every3.due(s)] == [3, 6, 9, 12]
    never = Cadence("memory", 0, max_interval_s=10, mtbf=fixed(60))
    assert not any(never.due(s) for s in range(1, 100))
    with pytest.raises(ConfigError, match="'auto' or a number of steps"):
        Cadence("memory", "often", max_interval_s=10, mtbf=fixed(60))


def run(cadence: Cadence, steps: int, step_s: float, cost_s: float, faults=lambda s: 0) -> list[int]:
    """Drive a cadence like a training loop; return the steps it saved after."""
    saved, pending = [], None
    for s in range(1, steps + 1):
        cadence.update(step_s=step_s, save_cost_s=pending, faults=faults(s), elapsed_s=s * step_s)
        pending = None
        if cadence.due(s):
            cadence.saved(s)
            saved.append(s)
            pending = cost_s  # measured by the next step
    return saved


def test_auto_measures_first_then_saves_every_young_daly_interval():
    choices = []
    c = Cadence("memory", "auto", max_interval_s=300, mtbf=fixed(3600), on_choice=lambda n, ch: choices.append(ch))
    saved = run(c, 400, step_s=0.5, cost_s=0.01)
    assert saved[0] == 1  # the first save measures what one costs
    gaps = {b - a for a, b in zip(saved, saved[1:])}
    ideal = young_daly_interval(0.01, 3600)  # 8.47 s: 17 steps of 0.5 s
    assert gaps == {math.ceil(ideal / 0.5)}
    assert len(choices) == 1 and choices[0].seconds == pytest.approx(ideal)


def test_auto_saves_every_step_when_faults_are_frequent_and_rarely_when_not():
    often = run(Cadence("memory", "auto", max_interval_s=300, mtbf=fixed(5)), 100, step_s=0.5, cost_s=0.01)
    rare = run(Cadence("memory", "auto", max_interval_s=300, mtbf=fixed(3600)), 100, step_s=0.5, cost_s=0.01)
    assert len(often) >= 60 and len(rare) <= 8


def test_auto_follows_the_observed_fault_rate():
    c = Cadence("memory", "auto", max_interval_s=300, mtbf=lambda f, e: estimate_mtbf(None, f, e))
    saved = run(c, 400, step_s=0.5, cost_s=0.01, faults=lambda s: 0 if s < 200 else 10)
    before = [s for s in saved if 20 < s < 200]
    after = [s for s in saved if s > 220]
    assert len(after) > 2 * len(before) > 0  # 10 faults in 100 s: MTBF 10 s instead of an hour


def test_auto_keeps_its_choice_through_noise_and_reports_each_change():
    choices = []
    c = Cadence("storage", "auto", max_interval_s=1800, mtbf=fixed(600), on_choice=lambda n, ch: choices.append(ch))
    for cost in (0.5, 0.1, 0.105, 0.095, 0.1, 0.11):
        c.update(step_s=0.5, save_cost_s=cost, faults=0, elapsed_s=10)
    assert len(choices) == 2  # the first (allocating) save's, then the steady one; noise kept it
    c.update(step_s=0.5, save_cost_s=2.0, faults=0, elapsed_s=10)
    c.update(step_s=0.5, save_cost_s=2.0, faults=0, elapsed_s=10)
    c.update(step_s=0.5, save_cost_s=2.0, faults=0, elapsed_s=10)
    assert len(choices) == 3 and choices[-1].seconds > choices[-2].seconds * 1.2


def test_ranks_fed_the_same_numbers_save_at_the_same_steps():
    a, b = (Cadence("memory", "auto", max_interval_s=60, mtbf=fixed(300)) for _ in range(2))
    assert run(a, 300, 0.2, 0.03) == run(b, 300, 0.2, 0.03)


def test_a_resumed_run_counts_its_interval_from_the_restored_step():
    c = Cadence("memory", "auto", max_interval_s=300, mtbf=fixed(3600))
    run(c, 50, step_s=0.5, cost_s=0.01)
    c.saved(30)  # resumed at step 30
    assert not c.due(30) and not c.due(31)


def test_no_second_save_is_due_while_the_first_ones_cost_is_on_its_way():
    c = Cadence("storage", "auto", max_interval_s=5, mtbf=fixed(1e9))
    assert c.due(1)
    c.saved(1)
    for s in range(2, 8):  # slow storage: the first save is still being written (6 steps of 0.5 s)
        c.update(step_s=0.5, save_cost_s=None, faults=0, elapsed_s=s * 0.5)
        assert not c.due(s), s
    c.update(step_s=0.5, save_cost_s=2.0, faults=0, elapsed_s=4.0)  # measured: now it has an interval
    assert c.choice is not None and not c.due(8)


def test_a_first_cost_that_never_arrives_still_saves_once_the_cap_is_reached():
    c = Cadence("storage", "auto", max_interval_s=2, mtbf=fixed(1e9))
    c.saved(1)
    due = []
    for s in range(2, 8):
        c.update(step_s=0.5, save_cost_s=None, faults=0, elapsed_s=s * 0.5)
        due.append(c.due(s))
    assert due == [False, False, False, True, True, True]  # 2 s of training unsaved: the cap


def test_a_resume_or_a_copy_made_by_another_tier_does_not_wait_for_a_cost():
    resumed = Cadence("memory", "auto", max_interval_s=300, mtbf=fixed(3600))
    resumed.saved(30, measured=False)
    assert not resumed.due(30) and resumed.due(31)  # its first own save measures the cost


def test_while_the_first_cost_is_on_its_way_saves_stay_due_as_often_as_the_mtbf_asks():
    # Young/Daly's interval never exceeds the MTBF, whatever a save costs: with a fault every
    # 0.1 s, every step of 0.5 s is due before any cost is known.
    c = Cadence("memory", "auto", max_interval_s=300, mtbf=fixed(0.1))
    c.saved(1)
    for s in range(2, 5):
        c.update(step_s=0.5, save_cost_s=None, faults=0, elapsed_s=s * 0.5)
        assert c.due(s)
        c.saved(s)
