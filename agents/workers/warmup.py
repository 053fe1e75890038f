"""How spares warm up: what they import, and how long a replacement may warm on idle CPU only.

Pure decisions (no processes here): :func:`warm_imports_for` picks a job's warm imports,
:func:`idle_warm_grace` how long a replacement spare warms at SCHED_IDLE before the pool boosts
it, from :func:`change_interval`, the expected time until the job's membership next changes.
"""

from __future__ import annotations

IDLE_WARM_GRACE = 2.0
"""The least time a replacement spare warms at SCHED_IDLE before it is moved to normal priority."""
IDLE_WARM_GRACE_MAX = 600.0
"""The most (see :func:`idle_warm_grace`)."""


def idle_warm_grace(change_interval_s: float) -> float:
    """Seconds a replacement spare may warm at SCHED_IDLE before it is boosted to normal priority,
    given the expected seconds until the job's membership next changes (a fault, or a node
    joining: either round needs warm spares).

    Boosting takes CPU from training on a machine that has none idle (one spare's warm-up is
    several CPU-seconds); not boosting risks a cold start if the next change comes before the
    spare is warm. A tenth of the expected interval, within [2 s, 600 s], keeps that risk near a
    tenth, while a job whose membership rarely changes warms its spares on idle CPU only.
    """
    return min(max(0.1 * change_interval_s, IDLE_WARM_GRACE), IDLE_WARM_GRACE_MAX)


def change_interval(mtbf_s: float, rounds: int, age_s: float) -> float:
    """Expected seconds between membership changes: the MTBF, or the job's observed mean time
    between rounds (faults and joins alike) when that is shorter."""
    observed = age_s / (rounds - 1) if rounds > 1 and age_s > 0 else float("inf")
    return min(mtbf_s, observed)


DEFAULT_WARM_IMPORTS = (
    "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
    "torch.distributed.checkpoint", "ftrt.checkpoint.checkpointer", "ftrt.checkpoint.pointer",
)
"""What spares import while they wait. DDP and every torch.optim optimizer import torch._dynamo
on first use (2-3 s here), so a spare that skipped it would pay it after its assignment; a
restore needs DCP, ftrt's checkpointer and the etcd client (~0.3 s more here)."""


def warm_imports_for(module: str | None) -> tuple[str, ...]:
    """The default warm imports for a job run as ``-m module`` (None: a script).

    An ftrt module's package is imported too: ``runpy`` imports it anyway before it runs the
    module, and ftrt's packages read nothing from the environment at import (a worker's rank
    and round arrive after the spare imported them). A user's package may (say, a device chosen
    from ``LOCAL_RANK`` at import), so it is warm-imported only when named with ``--warm-import``.
    """
    if not module or module.split(".")[0] != "ftrt":
        return DEFAULT_WARM_IMPORTS
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return DEFAULT_WARM_IMPORTS
    if spec is None:
        return DEFAULT_WARM_IMPORTS
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    return (*DEFAULT_WARM_IMPORTS, package) if package and package != "ftrt" else DEFAULT_WARM_IMPORTS
