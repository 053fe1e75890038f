"""The agent's state machine: states that carry their data, and the transitions allowed between them.

::

    Starting --registered--> Waiting --round includes us--> Running
    Running --round changed (loss, join, failure elsewhere)--> Running (new workers)
    Running --our worker failed or hung / round excludes us--> Waiting
    Running --all our workers exited 0--> Finished --job succeeded / barrier--> Succeeded
    Waiting, Running --SIGTERM, preemption notice, ftrt drain--> Draining --left--> Stopped
    Draining --its workers finished the job--> Finished --(still draining)--> Stopped
    any live state --lease lost--> Fenced --re-registered--> Waiting
    any live state --job failed--> Failed;  --signal--> Stopped

Each state is a small object holding what the agent needs while in it (after Ray Train v2's
controller states): :class:`Running` the round its workers run in, :class:`Draining` its
:class:`Drain` and the round its workers still run in, and so on. :attr:`AgentState` names the kind
(what ``ftrt status``, the Status RPC and the probes show); :func:`check_transition` refuses a
change the diagram above does not allow, so an unexpected event is a loud bug rather than a silent
wrong state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Union

from ftrt.roster import LocalRound


class AgentState(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    DRAINING = "draining"
    FENCED = "fenced"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (AgentState.SUCCEEDED, AgentState.FAILED, AgentState.STOPPED)


_LIVE = {AgentState.STARTING, AgentState.WAITING, AgentState.RUNNING, AgentState.FINISHED, AgentState.DRAINING,
         AgentState.FENCED}
ALLOWED: dict[AgentState, set[AgentState]] = {
    AgentState.STARTING: {AgentState.WAITING},
    AgentState.WAITING: {AgentState.RUNNING, AgentState.WAITING, AgentState.DRAINING},
    AgentState.RUNNING: {AgentState.RUNNING, AgentState.WAITING, AgentState.FINISHED, AgentState.DRAINING},
    AgentState.FINISHED: {AgentState.WAITING, AgentState.RUNNING},
    AgentState.DRAINING: {AgentState.DRAINING, AgentState.FINISHED},
    AgentState.FENCED: {AgentState.WAITING},
}
for _s in _LIVE:
    ALLOWED.setdefault(_s, set()).update(
        {AgentState.FENCED, AgentState.SUCCEEDED, AgentState.FAILED, AgentState.STOPPED}
    )
ALLOWED[AgentState.FENCED].discard(AgentState.FENCED)


class InvalidTransition(RuntimeError):
    pass


def check_transition(old: AgentState, new: AgentState) -> None:
    """Raise :class:`InvalidTransition` unless ``old -> new`` is allowed."""
    if new not in ALLOWED.get(old, set()):
        raise InvalidTransition(f"agent state {old.value} -> {new.value} is not a valid transition")


@dataclass
class Drain:
    """A drain in progress: why, and until when it may take (the agent's monotonic clock)."""

    reason: str
    started: float
    deadline: float
    member: bool
    """Whether this node was in the job's current round when the drain began (a node that is not,
    say one that rejoined after losing its lease and waits to be admitted, has nothing to hand over)."""
    below_min_said: bool = False


@dataclass(frozen=True)
class Starting:
    """Before the node registered."""

    kind: ClassVar[AgentState] = AgentState.STARTING
    seen_round: int = 0


@dataclass(frozen=True)
class Waiting:
    """Registered, with no workers running: waiting for a round that includes this node (after the
    join, a failure, or a round without it). ``seen_round``: the last round this node acted on, so
    a round is acted on once (0 before the first)."""

    kind: ClassVar[AgentState] = AgentState.WAITING
    seen_round: int = 0


@dataclass(frozen=True)
class Running:
    """This node's workers run in ``round``."""

    kind: ClassVar[AgentState] = AgentState.RUNNING
    round: LocalRound

    @property
    def seen_round(self) -> int:
        return self.round.round


@dataclass(frozen=True)
class Finished:
    """Every worker of ``round`` here exited 0 (at ``since``, monotonic); waiting for the job's end."""

    kind: ClassVar[AgentState] = AgentState.FINISHED
    round: LocalRound
    since: float

    @property
    def seen_round(self) -> int:
        return self.round.round


@dataclass(frozen=True)
class Draining:
    """Leaving the job gracefully (:attr:`drain`). Its workers still run in ``round`` until the round
    without this node replaces it (None once they stopped); it starts no new ones."""

    kind: ClassVar[AgentState] = AgentState.DRAINING
    drain: Drain
    round: LocalRound | None
    seen_round: int


@dataclass(frozen=True)
class Fenced:
    """The lease was lost (``reason``): workers stopped; rejoining as a new member."""

    kind: ClassVar[AgentState] = AgentState.FENCED
    reason: str
    seen_round: int


@dataclass(frozen=True)
class Ended:
    """Terminal: ``kind`` is SUCCEEDED, FAILED or STOPPED."""

    kind: AgentState
    seen_round: int


State = Union[Starting, Waiting, Running, Finished, Draining, Fenced, Ended]
"""Any agent state."""
