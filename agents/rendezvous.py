"""The rendezvous as seen by one agent: its view of etcd, the decision loop and fenced writes.

One watch on ``/ftrt/<job>/rdzv/`` keeps :class:`~ftrt.agents.decide.View` current. Whenever it
changes (or a decision's wake-up time comes), :func:`~ftrt.agents.decide.decide_round` runs and
its action is applied:

- ``WRITE_ROUND``: a transaction that succeeds only if the round key is unchanged since the view
  read it (compare-and-swap on its mod revision); it also clears restart requests and master
  records of older rounds. The decision's proposer (first surviving member) writes at once; the
  others wait ``backup_delay`` first, in case the proposer is the node that just died.
- ``FAIL`` / ``SUCCEED``: the job's terminal state, written only if absent.

Every other write of the job is fenced by the round: a restart request names its round, a master
record is written only while the round key is unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

from ftrt.agents.decide import Action, Decision, RendezvousConfig, View, decide_round, proposer
from ftrt.agents.keys import JobKeys
from ftrt.agents.records import (
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


class Rendezvous:
    """Keeps the view of one job and drives its rounds. See the module docstring."""

    def __init__(
        self,
        store: Store,
        keys: JobKeys,
        node_id: str,
        cfg: RendezvousConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        backup_delay: float = 0.3,
        on_event: Callable[[str, str], None] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.cfg = cfg
        self.clock = clock
        self.backup_delay = backup_delay
        self.on_event = on_event or (lambda kind, msg: None)
        self.on_change = on_change or (lambda: None)
        self.view = View(changed_at=clock(), waiting_since=clock())
        self.round_mod_revision = 0
        self.masters: dict[int, MasterRecord] = {}
        self.changed = asyncio.Event()
        """Set on every change of the view; consumers clear it."""
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._last_reason = ""
        self._pending_since: dict[int, float] = {}
        self.synced = asyncio.Event()
        self._waiters: list[asyncio.Future] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        revision = await self._resync()
        self._tasks = [
            asyncio.create_task(self._watch(revision + 1), name="rdzv-watch"),
            asyncio.create_task(self._decide_loop(), name="rdzv-decide"),
        ]
        self.synced.set()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # -- view maintenance -----------------------------------------------------------------------
    async def _resync(self) -> int:
        kvs, revision = await self.store.get_prefix(self.keys.rdzv)
        view = self.view
        view.nodes.clear()
        view.requests.clear()
        view.round, view.job = None, None
        self.masters.clear()
        self.round_mod_revision = 0
        for kv in kvs:
            self._apply(WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease))
        self._touched()
        return revision

    async def _watch(self, start: int) -> None:
        while True:
            it = self.store.watch_prefix(self.keys.rdzv, start)
            try:
                async for batch in it:
                    for ev in batch:
                        self._apply(ev)
                    start = batch[-1].revision + 1
                    self._touched()
            except WatchCompacted:
                log.warning("rendezvous watch fell behind compaction; re-reading the job state")
                start = await self._resync() + 1
            except StoreError as exc:
                log.warning("rendezvous watch failed (%s); retrying", exc)
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

    # -- decisions ------------------------------------------------------------------------------
    async def _decide_loop(self) -> None:
        while True:
            self._wake.clear()
            wake_at = await self._decide_once()
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
        try:
            if d.action is Action.WRITE_ROUND:
                return await self._maybe_write_round(now, d)
            if d.action is Action.FAIL:
                await self.write_job_state("failed", d.reason)
            elif d.action is Action.SUCCEED:
                await self.write_job_state("succeeded", d.reason)
            elif d.action is Action.WAIT:
                return d.wake_at
        except StoreError as exc:
            log.warning("rendezvous write failed (%s); will retry", exc)
            return self.clock() + 0.2
        return None

    async def _maybe_write_round(self, now: float, d: Decision) -> float | None:
        assert d.round is not None
        writer = proposer(d, self.view)
        if writer is not None and writer != self.node_id:
            since = self._pending_since.setdefault(d.round.round, now)
            if now < since + self.backup_delay:
                return since + self.backup_delay
        await self._write_round(d.round)
        return None

    async def _write_round(self, new: RoundRecord) -> bool:
        new = dataclasses.replace(new, created=time.time(), writer=self.node_id)
        res = await self.store.txn(
            [Compare.mod_revision(self.keys.round, self.round_mod_revision)],
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
        res = await self.store.txn([Compare.absent(self.keys.state)], [Put(self.keys.state, encode(body))])
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
