"""The job as one agent sees it in etcd, kept current by watches.

Every agent watches ``/ftrt/<job>/rdzv/``: the round, restart requests, master records, the job's
terminal state and the decider record. That is O(1) keys, so a join of N nodes costs each agent
O(1) watch events, not O(N). The node records (``/ftrt/<job>/nodes/``) are read and watched only
while this agent decides (:meth:`JobView.watch_nodes`). Each change is folded into a
:class:`~ftrt.agents.rendezvous.decide.View`, stamped with local times where membership moved, and reported
through ``on_change``.

The round key holds only the round's header (:mod:`ftrt.roster`); a new header becomes the view's
round once the member groups this agent needs are read: its own group and those of its ring
successors, or every group while it decides. Shards are kept by (group, round written), so a
group that did not change is not read again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ftrt.agents.rendezvous.decide import View
from ftrt.jobkeys import JobKeys
from ftrt.records import (DeciderRecord, DrainRequest, JobState, MasterRecord, Member, NodeRecord, RestartRequest,
                          RoundHeader, decode)
from ftrt.roster import LocalRound, ShardRead, decode_header, read_shards, wanted_groups
from ftrt.errors import StoreError, WatchCompacted
from ftrt.store.api import Store, WatchEvent

log = logging.getLogger(__name__)


class JobView:
    """The job's rendezvous keys (and, on the decider, its node records) as this agent last saw them."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, *, successors: int, clock: Callable[[], float],
                 on_change: Callable[[], None]) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.successors = successors
        """How many ring successors this agent asks about (the member groups it reads follow)."""
        self.clock = clock
        self.on_change = on_change
        self.view = View(changed_at=clock(), waiting_since=clock())
        """The job as this agent sees it; ``view.round`` is a :class:`~ftrt.roster.LocalRound`;
        ``view.nodes`` is filled only while it watches the nodes."""
        self.round_mod_revision = 0
        """The mod revision of the round in ``view.round``: writes fenced by the round compare it."""
        self._pending: tuple[RoundHeader, bytes, int] | None = None
        """The newest round header seen and not yet in the view (its groups are being read)."""
        self._shards: dict[tuple[int, int], tuple[Member, ...]] = {}
        """Member groups read, by (group, round its shard was written in)."""
        self.masters: dict[int, MasterRecord] = {}
        self.decider: DeciderRecord | None = None
        """The decider the last election's winner announced (for logs and ``ftrt status``)."""
        self.drain: DrainRequest | None = None
        """``ftrt drain``'s request for this node, if one stands (the agent checks the incarnation)."""
        self._tasks: list[asyncio.Task] = []
        self._nodes_task: asyncio.Task | None = None
        self._following_nodes = False
        """Node records count only while this is True: a stopped node watch's late events do not."""

    async def start(self) -> None:
        revision = await self._resync()
        self._tasks = [asyncio.create_task(self._watch(self.keys.rdzv, revision + 1, self._resync, settle=True),
                                           name="rdzv-watch")]

    async def close(self) -> None:
        await self.stop_nodes()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def watch_nodes(self) -> None:
        """Read every node record and follow them from now on (the decider's duty)."""
        if self._following_nodes:
            return
        self._following_nodes = True
        try:
            revision = await self._resync_nodes()
        except BaseException:
            await self.stop_nodes()
            raise
        self._nodes_task = asyncio.create_task(
            self._watch(self.keys.nodes, revision + 1, self._resync_nodes), name="rdzv-nodes-watch")

    async def stop_nodes(self) -> None:
        """Stop following the node records and forget them."""
        self._following_nodes = False
        task, self._nodes_task = self._nodes_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.view.nodes.clear()
        self.view.ready_since.clear()

    # -- reading and watching ---------------------------------------------------------------------
    async def _resync(self) -> int:
        """Re-read everything under ``rdzv/`` (at start and after the watch fell behind). The
        round in the view stays until the one read replaces it (no moment without a round)."""
        kvs, revision = await self.store.get_prefix(self.keys.rdzv)
        view = self.view
        view.requests.clear()
        view.job = None
        self.drain = None
        self.masters.clear()
        self.decider = None
        self.round_mod_revision = 0  # the round read replaces the view's (etcd may have been restored)
        self._apply_all(kvs)
        if not any(kv.key == self.keys.round for kv in kvs):
            view.round, self._pending = None, None
        await self._settle()
        self.on_change()
        return revision

    async def _resync_nodes(self) -> int:
        """Re-read every node record (on becoming the decider, and after its watch fell behind)."""
        kvs, revision = await self.store.get_prefix(self.keys.nodes)
        self.view.nodes.clear()
        self.view.ready_since.clear()
        self.view.changed_at = self.clock()
        self._apply_all(kvs)
        self.on_change()
        return revision

    def _apply_all(self, kvs) -> None:
        """Fold a read's key-values into the view as if they had just been put."""
        for kv in kvs:
            self.apply(WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease))

    # -- the round: header, then the member groups this agent needs ---------------------------------
    async def resolve(self) -> None:
        """Make the newest round header seen the view's round, once the groups this agent needs
        are read. A header whose shards are gone was replaced; the newer one is on its way."""
        while self._pending is not None:
            pending = self._pending
            header, raw, revision = pending
            if revision <= self.round_mod_revision:
                if self._pending is pending:
                    self._pending = None
                continue
            loaded = {g: self._shards[(g, ref.shard)] for g, ref in enumerate(header.groups)
                      if ref.count and (g, ref.shard) in self._shards}
            while want := wanted_groups(header, loaded, self.node_id, self.successors, self._following_nodes):
                got = await self._read(header, want)
                if got.unreadable:
                    if self._pending is not pending:
                        break  # a newer round came meanwhile (most often why a shard is gone)
                    (log.error if got.damaged else log.info)(
                        "round %d cannot be taken yet (%s); waiting for the next round",
                        header.round, "; ".join(got.unreadable.values()))
                    return
                loaded.update(got.found)
            else:
                if self._pending is pending:
                    self._pending = None
                self._set_round(LocalRound(header, raw, loaded), revision)

    async def _settle(self) -> None:
        """:meth:`resolve`, retried while etcd fails (the view never freezes on a failed read)."""
        while True:
            try:
                return await self.resolve()
            except StoreError as exc:
                log.warning("reading round members failed (%s); retrying", exc)
                await asyncio.sleep(0.2)

    def adopt(self, rnd: LocalRound, revision: int) -> None:
        """Take a round this agent wrote itself (with every group) without reading it back."""
        self._shards.update({(g, rnd.header.groups[g].shard): ms for g, ms in rnd.groups.items()})
        self._set_round(rnd, revision)

    async def ensure_complete(self) -> bool:
        """Read every member group of the view's round (the decider's need); False when the
        round was replaced meanwhile (the watch brings the new one, complete)."""
        cur = self.view.round
        if cur is None or cur.complete:
            return True
        got = await self._read(cur.header, wanted_groups(cur.header, cur.groups, self.node_id, self.successors, True))
        groups = {**cur.groups, **got.found}
        if got.unreadable:
            kv, _ = await self.store.get(self.keys.round)
            if kv is None or kv.mod_revision != self.round_mod_revision:
                return False  # replaced: the watch brings the new round, complete
            # The current round's shard is gone or damaged: decide as if that group had no
            # members. They are registered nodes, so the next round takes them back as newcomers.
            log.error("round %d: %s; the members of group(s) %s count as newcomers", cur.round,
                      "; ".join(got.unreadable.values()), ",".join(map(str, sorted(got.unreadable))))
            groups.update({g: () for g in got.unreadable})
        if self.view.round is cur:
            self.view.round = LocalRound(cur.header, cur.raw, groups)
        return self.view.round.complete

    async def _read(self, header: RoundHeader, groups: set[int]) -> ShardRead:
        """Read ``groups`` of ``header``'s round, keeping what was found."""
        got = await read_shards(self.store, self.keys, header, groups)
        self._shards.update({(g, header.groups[g].shard): ms for g, ms in got.found.items()})
        return got

    def _set_round(self, rnd: LocalRound, revision: int) -> None:
        if revision <= self.round_mod_revision:
            return  # an older header than the view's (the decider adopted its own write first)
        view = self.view
        now = self.clock()
        view.round = rnd
        self.round_mod_revision = revision
        view.waiting_since = None if rnd.active else (view.waiting_since or now)
        view.changed_at = now
        named = {(g, ref.shard) for g, ref in enumerate(rnd.header.groups) if ref.count}
        for key in [k for k in self._shards if k not in named]:
            del self._shards[key]

    async def _watch(self, prefix: str, start: int, resync: Callable[[], "asyncio.Future[int]"], *,
                     settle: bool = False) -> None:
        """Follow ``prefix`` from revision ``start``; ``settle``: this watch carries the round header,
        so a batch is folded in only once the round's groups are read."""
        while True:
            it = self.store.watch_prefix(prefix, start)
            try:
                async for batch in it:
                    for ev in batch:
                        self.apply(ev)
                    start = batch[-1].revision + 1
                    if settle:
                        await self._settle()
                    self.on_change()
            except WatchCompacted:
                log.warning("watch on %s fell behind compaction; re-reading it", prefix)
                start = 0  # re-read below
            except StoreError as exc:
                log.warning("watch on %s failed (%s); retrying", prefix, exc)
                await asyncio.sleep(0.2)
            except Exception:  # noqa: BLE001 - a malformed record must not freeze this agent's view
                log.exception("watch on %s hit an unexpected error; re-reading it", prefix)
                start = 0
            finally:
                await it.aclose()
            while start == 0:  # the re-read retries until etcd answers: the view never freezes
                try:
                    start = await resync() + 1
                except StoreError as exc:
                    log.warning("re-reading %s failed (%s); retrying", prefix, exc)
                    await asyncio.sleep(0.2)
                except Exception:  # noqa: BLE001 - nor does a surprise end the watch
                    log.exception("re-reading %s failed unexpectedly; retrying", prefix)
                    await asyncio.sleep(1.0)

    # -- folding changes in -----------------------------------------------------------------------
    def apply(self, ev: WatchEvent) -> None:
        """Fold one change into the view, stamping local times where membership moved (node
        records only while :meth:`watch_nodes` follows them; a round header waits for
        :meth:`resolve`)."""
        now = self.clock()
        key = ev.key
        view = self.view
        if key.startswith(self.keys.nodes):
            if self._following_nodes:
                self._apply_node(ev, now)
        elif key == self.keys.round:
            if ev.kind == "put":
                try:
                    self._pending = (decode_header(ev.value), ev.value, ev.revision)
                except ValueError as exc:
                    log.error("ignoring the value of %s: %s", key, exc)
        elif key == self.keys.decider:
            self.decider = None if ev.kind == "delete" else decode(DeciderRecord, ev.value)
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
        elif key == self.keys.drain(self.node_id):
            try:
                self.drain = None if ev.kind == "delete" else decode(DrainRequest, ev.value)
            except (ValueError, TypeError) as exc:
                log.error("ignoring the drain request %s: %s", key, exc)

    def _apply_node(self, ev: WatchEvent, now: float) -> None:
        view = self.view
        node_id = ev.key[len(self.keys.nodes):]
        old = view.nodes.get(node_id)
        if ev.kind == "delete":
            if old is not None:
                del view.nodes[node_id]
                view.ready_since.pop(node_id, None)
                view.changed_at = now
            return
        rec = decode(NodeRecord, ev.value, lease=ev.lease, revision=ev.create_revision)
        view.nodes[node_id] = rec
        if old is None or old.incarnation != rec.incarnation:
            view.ready_since.pop(node_id, None)
            view.changed_at = now
        if rec.ready and node_id not in view.ready_since:
            view.ready_since[node_id] = now
            view.changed_at = now
        if old is not None and (old.done_round != rec.done_round or old.leaving != rec.leaving):
            view.changed_at = now  # a drain settles like any change: nodes leaving together leave in one round
