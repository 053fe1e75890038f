"""The rendezvous decision, as a pure function of (now, view, config).

The job's decider (one agent, elected through a key under its lease; see
:mod:`ftrt.agents.rendezvous.rendezvous`) runs :func:`decide_round` on its view of etcd and writes the
proposed round by compare-and-swap; the others see the round in their watch and agree. The function
never performs I/O and gets time as an argument, so every rule below has a unit test with a fake
clock (``tests/agents/test_decide.py``).

Rules, in order:

1. A terminal job state stops everything.
2. When every member of the active round has finished (exited 0), the job succeeded.
3. No round yet: once ``min_nodes`` nodes are ready, wait ``first_round_wait_s`` for more (or
   start at once with ``max_nodes``), then write round 1.
4. A member lost (its key gone, or back with a new incarnation) or a restart request for the
   current round: after ``settle_s`` of quiet (so near-simultaneous faults make one round), write
   the next round with the survivors in their old order, plus ready newcomers up to ``max_nodes``.
   A failure without a lost member counts against ``max_restarts``; a lost member explains the
   failures it causes and costs nothing. A failure no restart can mend (a request of kind
   ``unfixable``: an import, syntax or usage error) fails the job at once.
5. A member draining (its record says ``leaving``; SIGTERM, a preemption notice or ``ftrt
   drain``): after ``settle_s``, write the next round without it, plus ready newcomers. This is a
   planned change, not a fault: no fault or restart is counted, so the old round's workers end
   at a step boundary and save it (:mod:`ftrt.agents.workers.boundary`).
6. Fewer than ``min_nodes`` survivors (after a loss or a drain): the round is written inactive
   (workers stop) and the job waits, up to ``join_timeout_s``, then fails.
7. Ready newcomers while the round is below ``max_nodes``: after ``join_settle_s`` (so nodes that
   start together join together), write a round that admits them.

The decider stores a round group by group (:mod:`ftrt.roster`): members keep the relative order
decided here, and a newcomer ends up last in its member group, which is the end of the round in a
job of up to 64 nodes (one group).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ftrt.records import JobState, Member, NodeRecord, RestartRequest, RoundRecord
from ftrt.roster import LocalRound


@dataclass(frozen=True)
class RendezvousConfig:
    """Knobs of the decision; all times in seconds."""

    min_nodes: int = 1
    max_nodes: int = 1
    settle_s: float = 0.05
    join_settle_s: float = 0.2
    first_round_wait_s: float = 0.5
    join_timeout_s: float = 600.0
    max_restarts: int = 3


@dataclass
class View:
    """What an agent knows of the job, plus the local times the decision needs.

    ``changed_at`` is when membership or requests last changed; ``waiting_since`` is when the
    job was first seen below its minimum (None while it is not); ``ready_since`` is when each
    node was first seen ready. All three are the observing agent's monotonic clock.
    """

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    round: LocalRound | RoundRecord | None = None
    """The current round; the decider's holds every member (a complete :class:`LocalRound`)."""
    requests: dict[str, RestartRequest] = field(default_factory=dict)
    job: JobState | None = None
    changed_at: float = 0.0
    waiting_since: float | None = None
    ready_since: dict[str, float] = field(default_factory=dict)


class Action(enum.Enum):
    NONE = "none"
    WAIT = "wait"
    WRITE_ROUND = "write_round"
    FAIL = "fail"
    SUCCEED = "succeed"


@dataclass(frozen=True)
class Decision:
    """What to do now. ``wake_at`` (for WAIT) is when deciding again may give another answer."""

    action: Action
    reason: str
    round: RoundRecord | None = None
    wake_at: float | None = None


def _alive(view: View, m: Member) -> bool:
    node = view.nodes.get(m.node_id)
    return node is not None and node.incarnation == m.incarnation


def _as_member(node: NodeRecord) -> Member:
    return Member(node.node_id, node.incarnation, node.nproc, agent_addr=node.agent_addr, lease=node.lease)


def _staying(view: View, m: Member) -> bool:
    """A member that is alive, not finished and not draining."""
    node = view.nodes.get(m.node_id)
    return node is not None and node.incarnation == m.incarnation and not node.done_round and not node.leaving


def _candidates(view: View) -> list[NodeRecord]:
    """Ready nodes, not draining, that are not (the same incarnation of) a member of the current round."""
    current = {(m.node_id, m.incarnation) for m in view.round.members} if view.round else set()
    pool = [
        n
        for n in view.nodes.values()
        if n.ready and not n.done_round and not n.leaving and (n.node_id, n.incarnation) not in current
    ]
    return sorted(pool, key=lambda n: (n.revision, n.node_id))


def _next_round(
    prev: LocalRound | RoundRecord | None,
    members: list[Member],
    cfg: RendezvousConfig,
    reason: str,
    restart_count: int,
    fault: bool = False,
) -> RoundRecord:
    return RoundRecord(
        round=(prev.round + 1) if prev else 1,
        members=tuple(members),
        active=len(members) >= cfg.min_nodes,
        restart_count=restart_count,
        faults=(prev.faults if prev else 0) + (1 if fault else 0),
        reason=reason,
        job_started=prev.job_started if prev else 0.0,
        planned_since=(prev.planned_since or prev.round) if prev is not None and prev.active and not fault else 0,
    )


def _names(nodes) -> str:
    return ", ".join(n.node_id for n in nodes) or "none"


def decide_round(now: float, view: View, cfg: RendezvousConfig) -> Decision:
    """Decide whether a new round must be written, and which. Pure; see the module docstring."""
    if view.job is not None:
        return Decision(Action.NONE, f"the job has {view.job.state}: {view.job.reason}")

    cur = view.round
    candidates = _candidates(view)

    if cur is None:
        return _first_round(now, view, cfg, candidates)

    if cur.active and cur.members and all(
        (n := view.nodes.get(m.node_id)) is not None
        and n.incarnation == m.incarnation
        and n.done_round == cur.round
        for m in cur.members
    ):
        return Decision(Action.SUCCEED, f"every member of round {cur.round} finished")

    lost = [m for m in cur.members if not _alive(view, m)]
    failures = [r for r in view.requests.values() if r.round == cur.round]
    if cur.active and (unfixable := [r for r in failures if r.kind == "unfixable"]):
        r = unfixable[0]
        return Decision(Action.FAIL, f"workers failed on {r.node_id} in a way no restart can mend ({r.detail}); "
                                     "fix that and launch the job again")
    if cur.active and (lost or failures):
        if now < view.changed_at + cfg.settle_s:
            return Decision(
                Action.WAIT, "settling after a membership change", wake_at=view.changed_at + cfg.settle_s
            )
        survivors = [m for m in cur.members if _staying(view, m)]
        room = max(0, cfg.max_nodes - len(survivors))
        members = survivors + [_as_member(n) for n in candidates[:room]]
        restart_count = cur.restart_count
        if lost:
            reason = f"lost {_names(lost)}"
        else:
            restart_count += 1
            detail = "; ".join(f"{r.node_id}: {r.kind} ({r.detail})" for r in failures)
            reason = f"worker failure on {detail}"
            if restart_count > cfg.max_restarts:
                return Decision(
                    Action.FAIL,
                    f"workers failed ({detail}) and the restart budget of "
                    f"{cfg.max_restarts} restarts is spent",
                )
        new = _next_round(cur, members, cfg, reason, restart_count, fault=True)
        if not new.active:
            new = replace(new, reason=f"{reason}; {len(members)} of at least {cfg.min_nodes} nodes left, waiting")
        return Decision(Action.WRITE_ROUND, new.reason, round=new)

    leaving = [m for m in cur.members if _alive(view, m) and view.nodes[m.node_id].leaving]
    if cur.active and leaving:
        if now < view.changed_at + cfg.settle_s:
            return Decision(Action.WAIT, "settling after a membership change", wake_at=view.changed_at + cfg.settle_s)
        staying = [m for m in cur.members if _staying(view, m)]
        room = max(0, cfg.max_nodes - len(staying))
        members = staying + [_as_member(n) for n in candidates[:room]]
        new = _next_round(cur, members, cfg, f"drained {_names(leaving)}", cur.restart_count)
        if not new.active:
            new = replace(new, reason=f"{new.reason}; {len(members)} of at least {cfg.min_nodes} nodes left, "
                                      "waiting for a newcomer")
        return Decision(Action.WRITE_ROUND, new.reason, round=new)

    if not cur.active:
        pool = [m for m in cur.members if _staying(view, m)] + [_as_member(n) for n in candidates]
        if len(pool) >= cfg.min_nodes:
            ready_at = _join_ready_at(view, candidates, cfg)
            if now < ready_at and len(pool) < cfg.max_nodes:
                return Decision(Action.WAIT, "settling joins", wake_at=ready_at)
            members = pool[: cfg.max_nodes]
            # A member lost while the job waited is dropped here: that counts as a fault, as every
            # round that drops a member does (agents tell a pure join by an unchanged count).
            dropped = any(not _alive(view, m) for m in cur.members)
            new = _next_round(cur, members, cfg, f"back to {len(members)} nodes", cur.restart_count, fault=dropped)
            return Decision(Action.WRITE_ROUND, new.reason, round=new)
        return _below_min(now, view, cfg, len(pool))

    if candidates and len(cur.members) < cfg.max_nodes:
        ready_at = _join_ready_at(view, candidates, cfg)
        room = cfg.max_nodes - len(cur.members)
        if now < ready_at and len(candidates) < room:
            return Decision(Action.WAIT, "settling joins", wake_at=ready_at)
        joining = candidates[:room]
        members = list(cur.members) + [_as_member(n) for n in joining]
        new = _next_round(cur, members, cfg, f"admitted {_names(joining)}", cur.restart_count)
        return Decision(Action.WRITE_ROUND, new.reason, round=new)

    return Decision(Action.NONE, f"round {cur.round} stands")


def _join_ready_at(view: View, candidates: list[NodeRecord], cfg: RendezvousConfig) -> float:
    """When the newest ready candidate has waited ``join_settle_s``."""
    seen = [view.ready_since.get(n.node_id, view.changed_at) for n in candidates]
    return (max(seen) if seen else view.changed_at) + cfg.join_settle_s


def _first_round(
    now: float, view: View, cfg: RendezvousConfig, candidates: list[NodeRecord]
) -> Decision:
    if len(candidates) >= cfg.max_nodes:
        members = [_as_member(n) for n in candidates[: cfg.max_nodes]]
        new = _next_round(None, members, cfg, f"first round with {len(members)} nodes", 0)
        return Decision(Action.WRITE_ROUND, new.reason, round=new)
    if len(candidates) >= cfg.min_nodes:
        # Start after first_round_wait_s counted from when the minimum was reached.
        times = sorted(view.ready_since.get(n.node_id, view.changed_at) for n in candidates)
        start_at = times[cfg.min_nodes - 1] + cfg.first_round_wait_s
        if now < start_at:
            return Decision(Action.WAIT, "waiting for more nodes before the first round", wake_at=start_at)
        members = [_as_member(n) for n in candidates]
        new = _next_round(None, members, cfg, f"first round with {len(members)} nodes", 0)
        return Decision(Action.WRITE_ROUND, new.reason, round=new)
    return _below_min(now, view, cfg, len(candidates))


def _below_min(now: float, view: View, cfg: RendezvousConfig, have: int) -> Decision:
    since = view.waiting_since if view.waiting_since is not None else now
    give_up = since + cfg.join_timeout_s
    if now >= give_up:
        live = [n for n in view.nodes.values() if not n.done_round]
        ready = sorted(n.node_id for n in live if n.ready)
        warming = sorted(n.node_id for n in live if not n.ready)
        return Decision(
            Action.FAIL,
            f"only {len(live)} of the required {cfg.min_nodes} nodes joined within "
            f"{cfg.join_timeout_s:g} s (ready: {', '.join(ready) or 'none'}; still warming up: "
            f"{', '.join(warming) or 'none'}); start more agents with the same --job-id and --etcd, "
            "or lower --nnodes",
        )
    return Decision(
        Action.WAIT,
        f"waiting for nodes: {have} of at least {cfg.min_nodes} ready",
        wake_at=give_up,
    )
