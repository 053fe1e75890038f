"""What spares import, and how long a replacement spare warms on idle CPU before it is boosted (pure)."""

from __future__ import annotations

from ftrt.agents.config import load_config
from ftrt.agents.workers.warmup import (
    DEFAULT_WARM_IMPORTS,
    IDLE_WARM_GRACE,
    IDLE_WARM_GRACE_MAX,
    change_interval,
    idle_warm_grace,
    warm_imports_for,
)


def test_spares_warm_on_idle_cpu_longer_when_membership_changes_are_rarer():
    assert idle_warm_grace(60) == 6  # a change a minute: boosted after 6 s
    assert idle_warm_grace(1) == IDLE_WARM_GRACE  # never less than the floor
    assert idle_warm_grace(3600 * 24) == IDLE_WARM_GRACE_MAX  # rare changes: idle CPU only, for long
    assert idle_warm_grace(60) < idle_warm_grace(600) < idle_warm_grace(3600)


def test_joins_count_as_changes_as_well_as_faults():
    assert change_interval(3600, rounds=1, age_s=500) == 3600  # only the first round: the MTBF
    assert change_interval(3600, rounds=11, age_s=300) == 30  # 10 changes in 5 minutes
    assert change_interval(20, rounds=3, age_s=300) == 20  # faults expected more often than seen


def test_spares_import_what_a_restore_needs_and_the_package_of_an_ftrt_module():
    assert {"torch.distributed.checkpoint", "ftrt.checkpoint.checkpointer"} <= set(DEFAULT_WARM_IMPORTS)
    assert warm_imports_for("ftrt.grpo") == (*DEFAULT_WARM_IMPORTS, "ftrt.grpo")  # a package: runpy imports it
    assert warm_imports_for("ftrt.examples.ddp_steps") == (*DEFAULT_WARM_IMPORTS, "ftrt.examples")  # its parent
    # A user's package may read its rank from the environment at import: only with --warm-import.
    assert warm_imports_for("mylab.train") == DEFAULT_WARM_IMPORTS
    assert warm_imports_for(None) == DEFAULT_WARM_IMPORTS  # a script
    assert warm_imports_for("ftrt.no_such_module") == DEFAULT_WARM_IMPORTS
    assert load_config(standalone=True, module="ftrt.grpo").warm_imports[-1] == "ftrt.grpo"
    assert load_config(standalone=True, module="ftrt.grpo", warm_imports=("torch",)).warm_imports == ("torch",)
