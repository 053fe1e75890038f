"""Ending a round at a step boundary: the agent asks, its workers save their step and stop.

When the membership changes without a fault (a node joins or drains), the running workers' state is
intact. Killing them mid-step, as a fault forces, would throw away the step in progress and every
step since the last memory checkpoint, which with an ``auto`` cadence can be many. Instead:

1. The agent writes the round it wants ended into its *round-end file*
   (:mod:`ftrt.roundendfile`): a few mapped bytes, like the fence file, so a worker polls it every
   step without a system call.
2. A worker that polls it (:meth:`ftrt.Runtime.round_ending`) says so once (report
   :class:`ftrt.reports.Boundary`). At its next step boundary it agrees with the other ranks that the round
   ends (the GRPO trainer rides on its step's all-reduce), saves a checkpoint of that step and
   exits.
3. The agent waits for the workers that said they poll, at most :func:`boundary_timeout`, then
   stops whatever still runs as it would for a fault. A script that never polls is stopped at once.

When the next round is inactive (a drain took the job below its minimum, or every node leaves at
once: a time limit), no member keeps a memory copy for it: the request is *durable*, and the
save should go to storage (:meth:`ftrt.Runtime.round_end_durable`).

Only a planned change (:func:`planned_change`) ends a round this way: after a fault the old round's
collectives cannot complete, so its workers are stopped at once.

The same file tells a draining node's workers that their node is leaving (:meth:`ftrt.Runtime.draining`),
before the round without it is written: a script can get ready, e.g. finish an asynchronous save.
"""

from __future__ import annotations

from ftrt.records import RoundRecord
from ftrt.roster import LocalRound

def planned_change(old: LocalRound | RoundRecord, new: LocalRound | RoundRecord) -> bool:
    """True when ``new`` replaces ``old`` without a fault: a node joined or drained (``new`` may be
    inactive, a drain below the minimum). The decider counts a fault for every round that drops a
    member of the one before (lost, back with a new incarnation, or a worker failure) but a
    drained one, so no fault counted in between means every member of ``old`` is in ``new`` or
    left on purpose; an agent need not know every member to tell."""
    return new.faults == old.faults


BOUNDARY_WAIT_MIN = 2.0
BOUNDARY_WAIT_MAX = 60.0


def boundary_timeout(step_interval_s: float | None) -> float:
    """How long an agent waits for its workers to reach a step boundary, save and exit: the rest
    of a step, a save, and an exit fit in three steps plus a second (2-60 s; 10 s while no step
    time is known)."""
    if step_interval_s is None:
        return 10.0
    return min(max(3 * step_interval_s + 1.0, BOUNDARY_WAIT_MIN), BOUNDARY_WAIT_MAX)
