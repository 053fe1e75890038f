"""How long a replacement spare warms on idle CPU before it is boosted (pure)."""

from __future__ import annotations

from ftrt.agents.workers import IDLE_WARM_GRACE, IDLE_WARM_GRACE_MAX, idle_warm_grace


def test_spares_warm_on_idle_cpu_longer_when_faults_are_rarer():
    assert idle_warm_grace(60) == 15  # a fault a minute: boosted after 15 s
    assert idle_warm_grace(1) == IDLE_WARM_GRACE  # never less than the floor
    assert idle_warm_grace(3600) == IDLE_WARM_GRACE_MAX  # rare faults: idle CPU only, for long
    assert idle_warm_grace(60) < idle_warm_grace(600) < idle_warm_grace(3600)
