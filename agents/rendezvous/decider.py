"""The decider: while this agent leads the election, it turns the job view into rounds.

It runs :func:`~ftrt.agents.rendezvous.decide.decide_round` on the :class:`~ftrt.agents.rendezvous.jobview.JobView` (which
then follows every node record) and carries out the decision:

- ``WRITE_ROUND``: a transaction that succeeds only if the round key is unchanged since the view
  read it (compare-and-swap on its mod revision) and this agent still leads (the election's
  fence). It writes the round's header and the member groups that changed (:mod:`ftrt.roster`),
  and clears restart requests and master records of older rounds.
- ``FAIL`` / ``SUCCEED``: the job's terminal state, written only if absent (same fence).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from ftrt.agents.rendezvous.decide import Action, RendezvousConfig, decide_round
from ftrt.store.concurrency import Election
from ftrt.agents.rendezvous.jobview import JobView
from ftrt.records import JobState, RoundRecord, encode
from ftrt.roster import LocalRound, groups_for, plan_write
from ftrt.store.api import Compare, Delete, Put, Store, WatchEvent

log = logging.getLogger(__name__)


class Decider:
    """Decides one job's rounds for as long as ``election`` is won. See the module docstring."""

    def __init__(self, store: Store, jobview: JobView, election: Election, cfg: RendezvousConfig, node_id: str,
                 *, clock: Callable[[], float], on_event: Callable[[str, str], None]) -> None:
        self.store = store
        self.jobview = jobview
        self.keys = jobview.keys
        self.election = election
        self.cfg = cfg
        self.node_id = node_id
        self.clock = clock
        self.on_event = on_event
        self._last_reason = ""

    async def step(self) -> tuple[bool, float | None]:
        """Decide once and act: (whether every write it tried held, when to decide again if
        nothing changes first)."""
        if not await self.jobview.ensure_complete():
            return True, None  # the round moved on; its header wakes us once read in full
        d = decide_round(self.clock(), self.jobview.view, self.cfg)
        if d.reason != self._last_reason:
            log.debug("rendezvous decision: %s (%s)", d.action.value, d.reason)
            self._last_reason = d.reason
        if d.action is Action.WRITE_ROUND:
            assert d.round is not None
            return await self.write_round(d.round), None
        if d.action is Action.FAIL:
            return await self.write_job_state("failed", d.reason), None
        if d.action is Action.SUCCEED:
            return await self.write_job_state("succeeded", d.reason), None
        return True, d.wake_at if d.action is Action.WAIT else None

    async def write_round(self, new: RoundRecord) -> bool:
        """Write the next round, fenced by the round's revision and the election."""
        now = time.time()
        new = dataclasses.replace(new, created=now, job_started=new.job_started or now, writer=self.node_id)
        plan = plan_write(new, groups_for(self.cfg.max_nodes), self.jobview.view.round, self.keys)
        res = await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.jobview.round_mod_revision), self.election.fence()],
            [*plan.ops, Delete(self.keys.requests, prefix=True), Delete(self.keys.masters, prefix=True)],
        )
        if res.succeeded:
            ids = [m.node_id for g in sorted(plan.shards) for m in plan.shards[g]]
            log.info(
                "round %d written: %s; %d members %s (world size %d)%s",
                new.round, new.reason, len(ids), _ids(ids), new.world_size, "" if new.active else " [inactive]",
            )
            self.on_event("round", f"round {new.round}: {new.reason}")
            # Take our own write now rather than waiting for the watch to echo it.
            self.jobview.adopt(LocalRound(plan.header, encode(plan.header), plan.shards), res.revision)
            self.jobview.on_change()
        return res.succeeded

    async def write_job_state(self, state: str, reason: str) -> bool:
        """Record the job's terminal state (only the first writer wins)."""
        view = self.jobview.view
        rnd = view.round.round if view.round else 0
        body = JobState(state=state, reason=reason, round=rnd, time=time.time())  # type: ignore[arg-type]
        res = await self.store.txn(
            [Compare.absent(self.keys.state), self.election.fence()], [Put(self.keys.state, encode(body))]
        )
        if res.succeeded:
            log.info("job %s: %s", state, reason)
            self.on_event(state, reason)
            self.jobview.apply(WatchEvent("put", self.keys.state, encode(body), res.revision))
            self.jobview.on_change()
        return res.succeeded


def _ids(ids: list[str], shown: int = 32) -> str:
    """Member ids for a log line (the first ``shown``, then how many more)."""
    if not ids:
        return "none"
    more = len(ids) - shown
    return ",".join(ids[:shown]) + (f",... (+{more})" if more > 0 else "")
