"""The agent's state machine: states and the transitions allowed between them.

::

    STARTING --registered--> WAITING --round includes us--> RUNNING
    RUNNING --round changed (loss, join, failure elsewhere)--> RUNNING (new workers)
    RUNNING --our worker failed or hung / round excludes us--> WAITING
    RUNNING --all our workers exited 0--> FINISHED --job succeeded / barrier--> SUCCEEDED
    any live state --lease lost--> FENCED --re-registered--> WAITING
    any live state --job failed--> FAILED;  --signal--> STOPPED

:meth:`Transitions.check` refuses anything else, so an unexpected event is a loud bug rather than
a silent wrong state.
"""

from __future__ import annotations

import enum


class AgentState(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FENCED = "fenced"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (AgentState.SUCCEEDED, AgentState.FAILED, AgentState.STOPPED)


_LIVE = {AgentState.STARTING, AgentState.WAITING, AgentState.RUNNING, AgentState.FINISHED, AgentState.FENCED}
ALLOWED: dict[AgentState, set[AgentState]] = {
    AgentState.STARTING: {AgentState.WAITING},
    AgentState.WAITING: {AgentState.RUNNING, AgentState.WAITING},
    AgentState.RUNNING: {AgentState.RUNNING, AgentState.WAITING, AgentState.FINISHED},
    AgentState.FINISHED: {AgentState.WAITING, AgentState.RUNNING},
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
