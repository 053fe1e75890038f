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
   A worker whose trainer has a coarser natural boundary (TRL's generation window: a checkpoint
   inside one is of no use to a round of another world size) says after which later step it ends
   the round (:meth:`ftrt.Runtime.round_ends_after`); the agent waits for those steps too, at
   their measured pace, within :data:`DEFERRED_WAIT_MAX` and a drain's deadline
   (:func:`boundary_deadline`).

When the next round is inactive (a drain took the job below its minimum, or every node leaves at
once: a time limit), no member keeps a memory copy for it: the request is *durable*, and the
save should go to storage (:meth:`ftrt.Runtime.round_end_durable`).

Only a planned change (:func:`planned_change`) ends a round this way: after a fault the old round's
collectives cannot complete, so its workers are stopped at once.

The same file tells a draining node's workers that their node is leaving (:meth:`ftrt.Runtime.draining`),
before the round without it is written: a script can get ready, e.g. finish an asynchronous save.
"""

from __future__ import annotations

from dataclasses import dataclass

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


DEFERRED_WAIT_MAX = 600.0
"""The longest an agent waits, from its request, for workers that end their round at a later step."""

UNKNOWN_STEP_S = 10.0
"""The time allowed per step while a worker's step time is not known yet."""


@dataclass(frozen=True)
class Deferral:
    """A worker said (at ``said_at``, monotonic, at step ``step``) that it ends ``round`` only after
    step ``end`` (:class:`ftrt.reports.BoundaryAt`)."""

    round: int
    said_at: float
    step: int
    end: int


def boundary_deadline(asked_at: float, step_interval_s: float | None, deferrals: list[Deferral]) -> float:
    """When an agent that asked its workers to end their round at ``asked_at`` stops waiting for
    them: :func:`boundary_timeout` after asking, or, for a worker that said it ends the round at a
    later step, that long after it said so plus its steps still to go at ``step_interval_s`` each
    (:data:`UNKNOWN_STEP_S` while unknown); never later than :data:`DEFERRED_WAIT_MAX` after asking
    (but not sooner than the plain timeout). Pure: the agent applies a drain's deadline on top."""
    base = boundary_timeout(step_interval_s)
    per_step = step_interval_s if step_interval_s is not None else UNKNOWN_STEP_S
    deadline = asked_at + base
    for d in deferrals:
        deadline = max(deadline, d.said_at + base + max(0, d.end - d.step) * per_step)
    return min(deadline, asked_at + max(base, DEFERRED_WAIT_MAX))
