"""The rendezvous as one agent takes part in it: its view of the job, the decider election, the
decider, and the writes every agent makes fenced by the round.

Three parts, each in its own module:

- :class:`~ftrt.agents.rendezvous.jobview.JobView`: the job's rendezvous keys as this agent sees them (and
  the node records while it decides);
- :class:`~ftrt.store.concurrency.Election`: each agent is a candidate under its lease; the first in
  the queue decides, and when it dies only its successor is woken;
- :class:`~ftrt.agents.rendezvous.decider.Decider`: while this agent leads, it applies
  :func:`~ftrt.agents.rendezvous.decide.decide_round` and writes rounds fenced by the election.

:class:`Rendezvous` runs them: one loop keeps the candidacy in step with the agent's lease (a
rejoin after a lost lease is a new candidacy), takes office when the campaign is won (announces
itself in ``rdzv/decider``, follows the node records) and decides whenever the view changes or a
decision's wake-up time comes. Every other write of the job is fenced by the round: a restart
request names its round, a master record is written only while the round key is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ftrt.agents.rendezvous.decide import RendezvousConfig, View
from ftrt.agents.rendezvous.decider import Decider
from ftrt.store.concurrency import Election
from ftrt.agents.rendezvous.jobview import JobView
from ftrt.jobkeys import JobKeys
from ftrt.records import DeciderRecord, MasterRecord, RestartRequest, encode
from ftrt.roster import LocalRound
from ftrt.errors import LeaseLost, RoundChanged, StoreError
from ftrt.store.api import Compare, Put, Store, WatchEvent

log = logging.getLogger(__name__)


Registration = Callable[[], "tuple[int, str] | None"]
"""Returns this agent's current ``(lease id, incarnation)``, or None while it holds no lease."""

RETRY_S = 0.2
"""Pause before the loop tries again after an etcd failure."""
REGISTRATION_POLL_S = 0.5
"""While this agent has no candidacy, how often the loop looks whether it registered (a rejoin
changes nothing under ``rdzv/``, so no watch event would wake it)."""


class Rendezvous:
    """One agent's part in its job's rendezvous. See the module docstring.

    ``registration`` tells the current lease and incarnation of this agent (they change when it
    rejoins after losing its lease); its candidacy runs under that lease. ``successors``: how many
    ring successors the agent asks the round about (peer monitoring, replicas).
    """

    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        node_id: str,
        cfg: RendezvousConfig,
        *,
        registration: Registration,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[str, str], None] | None = None,
        on_change: Callable[[], None] | None = None,
        successors: int = 2,
    ) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.cfg = cfg
        self.registration = registration
        self.clock = clock
        self.on_event = on_event or (lambda kind, msg: None)
        self.on_change = on_change or (lambda: None)
        self.jobview = JobView(store, keys, node_id, successors=successors, clock=clock, on_change=self._changed)
        self._wake = asyncio.Event()
        """Consumed by the loop only: the view changed, or a campaign ended."""
        self._election: Election | None = None
        self._campaign: asyncio.Task | None = None
        self._decider: Decider | None = None
        self._task: asyncio.Task | None = None

    @property
    def view(self) -> View:
        return self.jobview.view

    @property
    def masters(self) -> dict[int, MasterRecord]:
        return self.jobview.masters

    @property
    def deciding(self) -> bool:
        """Whether this agent decides the rounds now (it won the election and took office)."""
        return self._decider is not None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.jobview.start()
        self._task = asyncio.create_task(self._loop(), name="rdzv-decide")

    async def close(self) -> None:
        """Stop taking part: a closed rendezvous decides nothing, and its slot is freed for the next
        candidate at once (else it would go only with the lease)."""
        election = self._election
        tasks = [t for t in (self._task, self._campaign) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._campaign = None
        self._decider = None
        self._election = None
        if election is not None:
            await election.resign()
        await self.jobview.close()

    def _changed(self) -> None:
        self._wake.set()
        self.on_change()

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            wake_at = None
            try:
                await self._follow_registration()
                if self._election is None:
                    wake_at = self.clock() + REGISTRATION_POLL_S
                if self._decider is not None:
                    held, wake_at = await self._decider.step()
                    if not held and not await self._decider.election.still_leads():
                        await self._step_down("its candidacy is gone")
            except StoreError as exc:  # LeaseLost included: the registration moves on
                log.warning("rendezvous step failed (%s); will retry", exc)
                wake_at = self.clock() + RETRY_S
            except Exception:  # noqa: BLE001 - the loop must outlive a surprise (a malformed record)
                log.exception("rendezvous step failed unexpectedly; will retry")
                wake_at = self.clock() + RETRY_S
            timeout = None if wake_at is None else max(0.0, wake_at - self.clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def _follow_registration(self) -> None:
        """Keep one candidacy under the agent's current lease; take office once it wins."""
        mine = self.registration()
        lease = mine[0] if mine is not None else None
        if self._election is not None and self._election.lease_id != lease:
            old = self._election
            await self._step_down("its lease changed")
            await old.resign()  # its slot is freed now, not when (or if) the old lease expires
        if self._election is None and mine is not None:
            record = DeciderRecord(self.node_id, mine[1], time.time())
            self._election = Election(self.store, self.keys.election, self.node_id, mine[0], encode(record))
        if self._election is None or self._decider is not None:
            return
        if self._campaign is None:
            self._campaign = asyncio.create_task(self._election.campaign(), name="rdzv-campaign")
            self._campaign.add_done_callback(lambda _t: self._wake.set())
            return
        if not self._campaign.done():
            return
        campaign, self._campaign = self._campaign, None
        if campaign.cancelled():
            return
        if (exc := campaign.exception()) is not None:
            if isinstance(exc, LeaseLost):
                return  # the agent rejoins under a new lease; a new candidacy follows it
            raise exc if isinstance(exc, StoreError) else StoreError(f"the election failed: {exc}")
        await self._take_office(self._election)

    async def _take_office(self, election: Election) -> None:
        """Announce this agent as the decider and follow every node record."""
        res = await self.store.txn([election.fence()], [Put(self.keys.decider, election.value, lease=election.lease_id)])
        if not res.succeeded:
            await self._step_down("its candidacy was gone when it won")
            return
        self.jobview.apply(WatchEvent("put", self.keys.decider, election.value, res.revision, res.revision,
                                      election.lease_id))
        await self.jobview.watch_nodes()
        self._decider = Decider(self.store, self.jobview, election, self.cfg, self.node_id, clock=self.clock,
                                on_event=self.on_event)
        log.info("%s decides the rounds of job %s now (%d nodes registered)",
                 self.node_id, self.keys.job_id, len(self.view.nodes))
        self.on_event("decider", f"{self.node_id} decides rounds")

    async def _step_down(self, why: str) -> None:
        """End this candidacy (and the decider's office, if held)."""
        was = self._decider is not None
        self._decider = None
        if self._campaign is not None:
            self._campaign.cancel()
            await asyncio.gather(self._campaign, return_exceptions=True)
            self._campaign = None
        self._election = None
        await self.jobview.stop_nodes()
        if was:
            log.info("%s no longer decides rounds (%s)", self.node_id, why)

    # -- fenced writes for the agent ------------------------------------------------------------
    async def request_restart(self, rnd: int, kind: str, detail: str) -> None:
        """Ask for a new round because this node's workers failed in round ``rnd``."""
        cur = self.view.round
        if cur is None or cur.round != rnd:
            return  # round `rnd` is gone already; a request for it would restart its successor
        req = RestartRequest(self.node_id, rnd, kind, detail)  # type: ignore[arg-type]
        await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.jobview.round_mod_revision),
             Compare.value_is(self.keys.round, cur.raw)],
            [Put(self.keys.request(self.node_id), encode(req))],
        )
        self._wake.set()

    async def publish_master(self, rnd: LocalRound, addr: str, port: int) -> None:
        """Publish where round ``rnd``'s workers find their store; fails if the round moved on."""
        rec = MasterRecord(rnd.round, addr, port)
        res = await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.jobview.round_mod_revision),
             Compare.value_is(self.keys.round, rnd.raw)],
            [Put(self.keys.master(rnd.round), encode(rec))],
        )
        if not res.succeeded:
            raise RoundChanged(f"Round {rnd.round} was replaced before its master was published.")
        self.masters[rnd.round] = rec
