"""Which of a node's workers take the next round in place (pure).

Under ``--recovery in-place`` a round change replaces only the workers that cannot go on: the ones
that exited, and all of them when any live one has not said it changes rounds in place (a script
that never calls :meth:`ftrt.Runtime.init_process_group` keeps today's restart semantics, and a
node does not run half its ranks one way and half the other). The workers kept get the new round
over their control pipe (:meth:`~ftrt.agents.workers.pool.WorkerPool.hand_round`); spares take the
places of the others.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from ftrt.records import Member, NodeRecord


class Kept(Protocol):
    """What the decision reads of a worker (:class:`~ftrt.agents.workers.pool.Worker`)."""

    local_rank: int
    in_place: bool
    stopping: bool
    hosts_store: bool
    done_at: float | None

    @property
    def exit_code(self) -> int | None: ...


def keep_in_place(running: Sequence[Kept], *, nproc: int, recovery: str, holds_store: bool) -> dict[int, Kept]:
    """The workers of ``running`` that take the next round in place, by local rank; empty: replace
    every worker (``--recovery restart``, none alive, a live one that does not change rounds in
    place, one that is finishing its work, or a local rank 0 that cannot serve the round's store
    when this node must: ``holds_store``)."""
    if recovery != "in-place":
        return {}
    alive = [w for w in running if w.exit_code is None and not w.stopping]
    if not alive or not all(w.in_place and w.done_at is None for w in alive):
        return {}
    kept = {w.local_rank: w for w in alive if 0 <= w.local_rank < nproc}
    if holds_store and 0 in kept and not kept[0].hosts_store:
        return {}
    return kept


def job_runs_in_place(records: Iterable[NodeRecord], node_id: str) -> bool:
    """Whether a node joining the job finds workers that change rounds in place: another live node
    of the job, not leaving or finished, said so in its record. Every node runs the same script, so
    one says it for all; the joining node then starts its workers before it is admitted."""
    return any(r.in_place and r.node_id != node_id and not r.leaving and not r.done_round for r in records)


def is_join(old: Sequence[Member], new: Sequence[Member], *, faults_between: int) -> bool:
    """Whether round ``new`` only adds members to round ``old`` (a join): no fault between the two
    (a lost member, a member back with a new incarnation, or a failed worker counts one) and every
    member of ``old`` in ``new`` (same node, incarnation and number of workers). The workers kept
    from ``old`` lose no peer then, and may finish their step before they take ``new``
    (:attr:`ftrt.control.NewRound.adds_to`); a drain drops a member and is not one."""
    return not faults_between and bool(old) and set(old) <= set(new)


def take_round_timeout(reconfigure_timeout: float, hang_timeout: float, *, join: bool) -> float:
    """How long a worker kept in place has to take its next round before it is killed and replaced:
    ``--reconfigure-timeout``; at a join, also two steps, each at most ``--hang-timeout`` (a worker
    silent longer counts as hung anyway), since a loop that agrees on a join's step takes it at
    the start of the step after the one whose collective carried the agreement."""
    return max(reconfigure_timeout, 2 * hang_timeout) if join else reconfigure_timeout
