"""etcd's concurrency primitives, after its ``clientv3/concurrency`` package: a lease kept alive
(:class:`Session`) and a leader election among a bounded number of candidates (:class:`Election`).

Both work on any :class:`~ftrt.store.api.Store` under a key prefix the caller chooses; nothing here
knows about jobs. Agents use them for their membership and for choosing the job's decider
(:mod:`ftrt.agents.rendezvous.membership`, :mod:`ftrt.agents.rendezvous.rendezvous`), rollout servers for their
registration (:mod:`ftrt.rollout.server`).

Session
-------
:meth:`Session.start` grants the lease and renews it every TTL/3; :attr:`Session.lost` fires when the
lease is gone (revoked, expired) or could not be renewed before it ran out. :meth:`Session.orphan`
stops renewing and lets it expire; :meth:`Session.close` revokes it.

``valid_until`` is the latest local monotonic time at which the lease is surely still alive on the
server (the send time of the last successful renewal plus the TTL the server granted). An agent
fences itself (stops its workers) when that time passes without a renewal, and publishes it to its
workers through the fence file so they stop themselves even if the agent is frozen.

.. _election:

Election
--------
One candidate leads, chosen as etcd's own ``concurrency.Election`` chooses one. Candidates hold
*slots*: :data:`SLOTS` keys under the election's prefix, each taken with a create-if-absent
transaction under the holder's lease. A candidate tries the slot its name hashes to; while another
holds it, it watches that one key and tries again when it goes. A slot holder's place in the queue
is its key's create revision: it reads its *predecessor* (the slot key created last before its own)
and watches that one key until it is deleted, then looks again. The first in the queue leads.

Why slots: finding a predecessor is a range read that etcd answers by reading every key in the
range (a sort by create revision defeats its limit), so with every agent a candidate, a join of N
nodes cost N such reads of N keys (1024 nodes: 15 s of etcd time). With slots it reads at most
:data:`SLOTS` keys. When the leader dies, its lease takes its key away: its successor among the
slot holders leads, and the candidates that hashed to the leader's slot (N / :data:`SLOTS` on
average) race for the freed slot, one transaction each. No herd racing for one key.

A leader's writes carry :meth:`Election.fence`: its key still exists with the same create
revision, so a leader whose lease is gone can no longer write, even if it still believes it leads.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Callable

from ftrt.errors import LeaseLost, StoreError, WatchCompacted
from ftrt.store.api import Compare, Delete, Get, Put, Store

log = logging.getLogger(__name__)


class Session:
    """A lease kept alive in the background. See the module docstring."""

    def __init__(
        self,
        store: Store,
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_renew: Callable[[float], None] | None = None,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.clock = clock
        self.on_renew = on_renew
        self.lease_id = 0
        self.granted_ttl = 0.0
        self.valid_until = 0.0
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._task: asyncio.Task | None = None

    async def start(self) -> "Session":
        sent = self.clock()
        lease = await self.store.grant_lease(self.ttl)
        self.lease_id, self.granted_ttl = lease.id, lease.ttl
        self._renewed(sent + lease.ttl)
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="lease-keepalive")
        return self

    def _renewed(self, valid_until: float) -> None:
        self.valid_until = valid_until
        if self.on_renew is not None:
            self.on_renew(valid_until)

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()

    async def _keep_alive(self) -> None:
        interval = max(0.1, self.granted_ttl / 3)
        next_at = self.clock() + interval
        while not self.lost.is_set():
            await asyncio.sleep(max(0.0, next_at - self.clock()))
            remaining = self.valid_until - self.clock()
            if remaining <= 0:
                self._lose(
                    f"lease {self.lease_id:#x} could not be renewed within its {self.granted_ttl:g} s TTL"
                )
                return
            sent = self.clock()
            try:
                ttl = await asyncio.wait_for(
                    self.store.keep_alive(self.lease_id, timeout=remaining), timeout=remaining
                )
            except LeaseLost as exc:
                self._lose(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a renewal that failed in any way is retried until
                # the lease runs out; a keep-alive task that died of a surprise would fence the node later
                # without a word (an etcd leader loss once ended one that way)
                why = str(exc) or (f"no answer within {remaining:.2f} s" if isinstance(exc, asyncio.TimeoutError)
                                   else type(exc).__name__)
                log.warning("lease renewal failed (%s); %.2f s of lease left", why, self.valid_until - self.clock())
                next_at = self.clock() + min(0.1, interval)
                continue
            took = self.clock() - sent
            if took > interval:
                log.warning("lease renewal took %.2f s (%.2f s of lease were left)", took, remaining)
            # A renewal that returns after the lease ran out locally does not un-fence us.
            if self.clock() >= self.valid_until:
                self._lose(f"lease {self.lease_id:#x} ran out before its renewal returned")
                return
            self._renewed(sent + ttl)
            next_at = sent + interval

    def expired(self) -> bool:
        """Whether the lease may be gone on the server (local view; no I/O)."""
        return self.lost.is_set() or self.clock() >= self.valid_until

    def orphan(self) -> None:
        """Stop renewing; the lease expires by itself after its TTL."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        """Stop renewing and revoke the lease (its keys vanish at once)."""
        self.orphan()
        if self.lease_id and not self.lost.is_set():
            try:
                await self.store.revoke_lease(self.lease_id, timeout=2.0)
            except StoreError as exc:
                log.warning("could not revoke lease %#x: %s", self.lease_id, exc)
        self._lose("session closed")


SLOTS = 16
"""Most candidates a job's election has at once."""


def slot_of(candidate: str) -> int:
    """The slot a candidate (an agent: its node id) competes for, stable across its rejoins."""
    return zlib.crc32(candidate.encode()) % SLOTS


def slot_key(prefix: str, slot: int) -> str:
    """The key of slot ``slot`` under an election's ``prefix``."""
    return f"{prefix}slot-{slot:03d}"


class Election:
    """One candidacy under one lease (module docstring). :meth:`campaign`
    returns once it leads."""

    def __init__(self, store: Store, prefix: str, candidate: str, lease_id: int, value: bytes) -> None:
        self.store = store
        self.lease_id = lease_id
        self.prefix = prefix
        """Where the slot keys live (a job's: :attr:`ftrt.jobkeys.JobKeys.election`)."""
        self.key = slot_key(prefix, slot_of(candidate))
        self.value = value
        self.create_revision = 0
        """The slot key's create revision once this candidacy holds it (0 before)."""
        self.leader = False

    async def campaign(self) -> None:
        """Take the slot (waiting while another agent holds it), then return when every slot
        holder ahead has gone and this candidacy's key is still there. Raises
        :class:`~ftrt.errors.LeaseLost` if the lease is gone, StoreError on etcd failures."""
        while not self.create_revision:
            res = await self.store.txn([Compare.absent(self.key)], [Put(self.key, self.value, lease=self.lease_id)],
                                       [Get(self.key)])
            if res.succeeded:
                self.create_revision = res.revision
            elif res.results[0] and res.results[0][0].lease == self.lease_id:
                self.create_revision = res.results[0][0].create_revision  # ours already (a retried put)
            elif res.results[0]:
                await self._wait_deleted(self.key, res.revision + 1)
        while True:
            ahead, revision = await self.store.last_created(self.prefix, self.create_revision - 1)
            if ahead is None:
                if not await self.still_leads():  # first in a queue it has left: its lease went meanwhile
                    raise LeaseLost(f"The candidacy's key {self.key} is gone (its lease expired or was revoked).")
                self.leader = True
                return
            await self._wait_deleted(ahead.key, revision + 1)

    async def _wait_deleted(self, key: str, start: int) -> None:
        """Return once ``key`` is deleted at or after revision ``start`` (or history is compacted:
        the caller then looks again)."""
        it = self.store.watch_prefix(key, start)
        try:
            async for batch in it:
                if any(ev.kind == "delete" and ev.key == key for ev in batch):
                    return
        except WatchCompacted:
            return
        finally:
            await it.aclose()

    def fence(self) -> Compare:
        """The condition every leader write carries: this candidacy's key is still the one put."""
        return Compare(self.key, "create", "==", self.create_revision)

    async def still_leads(self) -> bool:
        """Whether the key is still there (a failed fenced write asks this)."""
        kv, _ = await self.store.get(self.key)
        return kv is not None and kv.create_revision == self.create_revision

    async def resign(self) -> None:
        """Leave the queue (delete the key if it is still this candidacy's)."""
        self.leader = False
        if not self.create_revision:
            return
        try:
            await self.store.txn([self.fence()], [Delete(self.key)])
        except StoreError as exc:  # the key goes with the lease anyway
            log.debug("could not delete candidate key %s: %s", self.key, exc)
