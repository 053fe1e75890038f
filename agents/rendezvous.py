"""The rendezvous as seen by one agent: its view of etcd, the decider election and fenced writes.

Every agent watches ``/ftrt/<job>/rdzv/``: the round, restart requests, master records, the job's
terminal state and the decider key. That is O(1) keys, so a join of N nodes costs each agent O(1)
watch events, not O(N).

One agent of the job is its *decider*. It holds ``rdzv/decider`` under its own lease, reads and
watches every node record (``/ftrt/<job>/nodes/``) and runs
:func:`~ftrt.agents.decide.decide_round` whenever that view changes (or a decision's wake-up time
comes). Its actions:

- ``WRITE_ROUND``: a transaction that succeeds only if the round key is unchanged since the view
  read it (compare-and-swap on its mod revision) and the decider key is still under this agent's
  lease; it also clears restart requests and master records of older rounds.
- ``FAIL`` / ``SUCCEED``: the job's terminal state, written only if absent (same decider fence).

The decider key goes with the decider's lease: when that agent dies (its lease revoked by a peer
that found it dead, or expired), every agent sees the key deleted and tries to take it with a
create-if-absent transaction; one wins, reads the node records and decides from then on.

Every other write of the job is fenced by the round: a restart request names its round, a master
record is written only while the round key is unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

from ftrt.agents.decide import Action, RendezvousConfig, View, decide_round
from ftrt.agents.keys import JobKeys
from ftrt.agents.records import (
    DeciderRecord,
    JobState,
    MasterRecord,
    NodeRecord,
    RestartRequest,
    RoundRecord,
    decode,
    encode,
)
from ftrt.errors import RoundChanged, StoreError, WatchCompacted
from ftrt.store.api import Compare, Delete, Put, Store, WatchEvent

log = logging.getLogger(__name__)


Registration = Callable[[], "tuple[int, str] | None"]
"""Returns this agent's current ``(lease id, incarnation)``, or None while it holds no lease."""


class Rendezvous:
    """Keeps the view of one job and, while this agent is the decider, drives its rounds.

    See the module docstring. ``registration`` tells the current lease and incarnation of this
    agent (they change when it rejoins after losing its lease); the decider key is taken under it.
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
    ) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.cfg = cfg
        self.registration = registration
        self.clock = clock
        self.on_event = on_event or (lambda kind, msg: None)
        self.on_change = on_change or (lambda: None)
        self.view = View(changed_at=clock(), waiting_since=clock())
        """The job as this agent sees it; ``view.nodes`` is filled only while it is the decider."""
        self.round_mod_revision = 0
        self.masters: dict[int, MasterRecord] = {}
        self.decider: DeciderRecord | None = None
        self.decider_lease = 0
        self.deciding = False
        """True while this agent holds the decider key and watches the node records."""
        self.changed = asyncio.Event()
        """Set on every change of the view; consumers clear it."""
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._nodes_task: asyncio.Task | None = None
        self._last_reason = ""
        self.synced = asyncio.Event()
        self._waiters: list[asyncio.Future] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        revision = await self._resync()
        self._tasks = [
            asyncio.create_task(self._watch(self.keys.rdzv, revision + 1, self._resync), name="rdzv-watch"),
            asyncio.create_task(self._decide_loop(), name="rdzv-decide"),
        ]
        self.synced.set()

    async def close(self) -> None:
        tasks = self._tasks + ([self._nodes_task] if self._nodes_task else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._nodes_task = [], None
        self.deciding = False  # a closed rendezvous decides nothing (its decider key goes with its lease)

    # -- view maintenance -----------------------------------------------------------------------
    async def _resync(self) -> int:
        """Re-read everything under ``rdzv/`` (at start and after the watch fell behind)."""
        kvs, revision = await self.store.get_prefix(self.keys.rdzv)
        view = self.view
        view.requests.clear()
        view.round, view.job = None, None
        self.masters.clear()
        self.decider, self.decider_lease = None, 0
        self.round_mod_revision = 0
        self._apply_all(kvs)
        return revision

    async def _resync_nodes(self) -> int:
        """Re-read every node record (on becoming the decider, and after its watch fell behind)."""
        kvs, revision = await self.store.get_prefix(self.keys.nodes)
        self.view.nodes.clear()
        self.view.ready_since.clear()
        self.view.changed_at = self.clock()
        self._apply_all(kvs)
        return revision

    def _apply_all(self, kvs) -> None:
        """Fold a read's key-values into the view as if they had just been put."""
        for kv in kvs:
            self._apply(WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease))
        self._touched()

    async def _watch(self, prefix: str, start: int, resync: Callable[[], "asyncio.Future[int]"]) -> None:
        while True:
            it = self.store.watch_prefix(prefix, start)
            try:
                async for batch in it:
                    for ev in batch:
                        self._apply(ev)
                    start = batch[-1].revision + 1
                    self._touched()
            except WatchCompacted:
                log.warning("watch on %s fell behind compaction; re-reading it", prefix)
                start = await resync() + 1
            except StoreError as exc:
                log.warning("watch on %s failed (%s); retrying", prefix, exc)
                await asyncio.sleep(0.2)
            finally:
                await it.aclose()

    def _touched(self) -> None:
        self.changed.set()
        self._wake.set()
        self.on_change()
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _apply(self, ev: WatchEvent) -> None:
        """Fold one change into the view, stamping local times where membership moved."""
        now = self.clock()
        key = ev.key
        view = self.view
        if key.startswith(self.keys.nodes):
            if not self.deciding:
                return  # a late event of a node watch this agent has stopped
            node_id = key[len(self.keys.nodes):]
            old = view.nodes.get(node_id)
            if ev.kind == "delete":
                if old is not None:
                    del view.nodes[node_id]
                    view.ready_since.pop(node_id, None)
                    view.changed_at = now
                return
            rec = dataclasses.replace(
                decode(NodeRecord, ev.value), lease=ev.lease, revision=ev.create_revision
            )
            view.nodes[node_id] = rec
            if old is None or old.incarnation != rec.incarnation:
                view.ready_since.pop(node_id, None)
                view.changed_at = now
            if rec.ready and node_id not in view.ready_since:
                view.ready_since[node_id] = now
                view.changed_at = now
            if old is not None and old.done_round != rec.done_round:
                view.changed_at = now
        elif key == self.keys.round:
            if ev.kind == "put":
                view.round = decode(RoundRecord, ev.value)
                self.round_mod_revision = ev.revision
                view.waiting_since = None if view.round.active else (view.waiting_since or now)
                view.changed_at = now
        elif key == self.keys.decider:
            if ev.kind == "delete":
                self.decider, self.decider_lease = None, 0
            else:
                self.decider, self.decider_lease = decode(DeciderRecord, ev.value), ev.lease
        elif key.startswith(self.keys.requests):
            node_id = key[len(self.keys.requests):]
            if ev.kind == "delete":
                view.requests.pop(node_id, None)
            else:
                view.requests[node_id] = decode(RestartRequest, ev.value)
                view.changed_at = now
        elif key.startswith(self.keys.masters):
            if ev.kind == "put":
                rec = decode(MasterRecord, ev.value)
                self.masters[rec.round] = rec
        elif key == self.keys.state:
            if ev.kind == "put":
                view.job = decode(JobState, ev.value)

    # -- the decider ----------------------------------------------------------------------------
    def _holds_decider(self) -> bool:
        mine = self.registration()
        return (
            mine is not None and self.decider is not None and self.decider_lease == mine[0]
            and self.decider.node_id == self.node_id
        )

    async def _campaign(self) -> None:
        """Take the decider key if it is free (create-if-absent under this agent's lease)."""
        mine = self.registration()
        if mine is None or self.decider is not None:
            return
        rec = DeciderRecord(self.node_id, mine[1], time.time())
        res = await self.store.txn(
            [Compare.absent(self.keys.decider)], [Put(self.keys.decider, encode(rec), lease=mine[0])]
        )
        if res.succeeded:
            self._apply(WatchEvent("put", self.keys.decider, encode(rec), res.revision, res.revision, mine[0]))

    async def _update_role(self) -> None:
        holds = self._holds_decider()
        if holds and not self.deciding:
            self.deciding = True
            try:
                revision = await self._resync_nodes()
            except BaseException:
                self.deciding = False  # tried again on the next pass
                self.view.nodes.clear()
                raise
            self._nodes_task = asyncio.create_task(
                self._watch(self.keys.nodes, revision + 1, self._resync_nodes), name="rdzv-nodes-watch"
            )
            log.info("%s decides the rounds of job %s now (%d nodes registered)",
                     self.node_id, self.keys.job_id, len(self.view.nodes))
            self.on_event("decider", f"{self.node_id} decides rounds")
        elif not holds and self.deciding:
            self.deciding = False
            task, self._nodes_task = self._nodes_task, None
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.view.nodes.clear()
            self.view.ready_since.clear()
            log.info("%s no longer decides rounds (the decider is now %s)", self.node_id,
                     self.decider.node_id if self.decider else "nobody")

    async def _decide_loop(self) -> None:
        while True:
            self._wake.clear()
            wake_at = None
            try:
                if self.decider is None:
                    await self._campaign()
                await self._update_role()
                if self.deciding:
                    wake_at = await self._decide_once()
            except StoreError as exc:
                log.warning("rendezvous step failed (%s); will retry", exc)
                wake_at = self.clock() + 0.2
            timeout = None if wake_at is None else max(0.0, wake_at - self.clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def _decide_once(self) -> float | None:
        now = self.clock()
        d = decide_round(now, self.view, self.cfg)
        if d.reason != self._last_reason:
            log.debug("rendezvous decision: %s (%s)", d.action.value, d.reason)
            self._last_reason = d.reason
        if d.action is Action.WRITE_ROUND:
            assert d.round is not None
            await self._write_round(d.round)
        elif d.action is Action.FAIL:
            await self.write_job_state("failed", d.reason)
        elif d.action is Action.SUCCEED:
            await self.write_job_state("succeeded", d.reason)
        elif d.action is Action.WAIT:
            return d.wake_at
        return None

    def _decider_fence(self) -> list[Compare]:
        """The condition every decider write carries: the decider key is still under our lease."""
        return [Compare(self.keys.decider, "lease", "==", self.decider_lease)]

    async def _write_round(self, new: RoundRecord) -> bool:
        now = time.time()
        new = dataclasses.replace(new, created=now, job_started=new.job_started or now, writer=self.node_id)
        res = await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.round_mod_revision), *self._decider_fence()],
            [
                Put(self.keys.round, encode(new)),
                Delete(self.keys.requests, prefix=True),
                Delete(self.keys.masters, prefix=True),
            ],
        )
        if res.succeeded:
            log.info(
                "round %d written: %s; members %s (world size %d)%s",
                new.round, new.reason, ",".join(new.node_ids) or "none", new.world_size,
                "" if new.active else " [inactive]",
            )
            self.on_event("round", f"round {new.round}: {new.reason}")
            # Apply our own write now rather than waiting for the watch to echo it.
            self._apply(WatchEvent("put", self.keys.round, encode(new), res.revision))
            self._touched()
        return res.succeeded

    async def write_job_state(self, state: str, reason: str) -> None:
        """Record the job's terminal state (only the first writer wins)."""
        rnd = self.view.round.round if self.view.round else 0
        body = JobState(state=state, reason=reason, round=rnd, time=time.time())  # type: ignore[arg-type]
        res = await self.store.txn(
            [Compare.absent(self.keys.state), *self._decider_fence()], [Put(self.keys.state, encode(body))]
        )
        if res.succeeded:
            log.info("job %s: %s", state, reason)
            self.on_event(state, reason)
            self._apply(WatchEvent("put", self.keys.state, encode(body), res.revision))
            self._touched()

    # -- fenced writes for the agent ------------------------------------------------------------
    async def request_restart(self, rnd: int, kind: str, detail: str) -> None:
        """Ask for a new round because this node's workers failed in round ``rnd``."""
        cur = self.view.round
        if cur is None or cur.round != rnd:
            return  # round `rnd` is gone already; a request for it would restart its successor
        req = RestartRequest(self.node_id, rnd, kind, detail)  # type: ignore[arg-type]
        await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.round_mod_revision),
             Compare.value_is(self.keys.round, encode(cur))],
            [Put(self.keys.request(self.node_id), encode(req))],
        )
        self._wake.set()

    async def publish_master(self, rnd: RoundRecord, addr: str, port: int) -> None:
        """Publish where round ``rnd``'s workers find their store; fails if the round moved on."""
        rec = MasterRecord(rnd.round, addr, port)
        res = await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.round_mod_revision),
             Compare.value_is(self.keys.round, encode(rnd))],
            [Put(self.keys.master(rnd.round), encode(rec))],
        )
        if not res.succeeded:
            raise RoundChanged(f"Round {rnd.round} was replaced before its master was published.")
        self.masters[rnd.round] = rec

    async def wait_master(self, rnd: int) -> MasterRecord | None:
        """Wait for round ``rnd``'s master record; None if the round is replaced first."""
        while True:
            if rnd in self.masters:
                return self.masters[rnd]
            cur = self.view.round
            if cur is None or cur.round != rnd or self.view.job is not None:
                return None
            await self.next_change()

    async def next_change(self) -> None:
        """Return after the next change of the view."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut
