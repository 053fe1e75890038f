"""The decider election: one agent of a job decides its rounds, chosen as etcd's own
``concurrency.Election`` chooses a leader, among a bounded number of candidates.

Candidates hold *slots*: :data:`SLOTS` keys under ``/ftrt/<job>/election/``, each taken with a
create-if-absent transaction under the holder's lease. An agent tries the slot its node id hashes
to; while another agent holds it, it watches that one key and tries again when it goes. A slot
holder's place in the queue is its key's create revision: it reads its *predecessor* (the slot
key created last before its own) and watches that one key until it is deleted, then looks again.
The first in the queue leads.

Why slots: finding a predecessor is a range read that etcd answers by reading every key in the
range (a sort by create revision defeats its limit), so with every agent a candidate, a join of N
nodes cost N such reads of N keys (1024 nodes: 15 s of etcd time). With slots it reads at most
:data:`SLOTS` keys. When the leader dies, its lease takes its key away: its successor among the
slot holders leads, and the agents that hashed to the leader's slot (N / :data:`SLOTS` on average)
race for the freed slot, one transaction each. No herd of every agent racing for one key.

A leader's writes carry :meth:`Election.fence`: its key still exists with the same create
revision, so a leader whose lease is gone can no longer write, even if it still believes it leads.
"""

from __future__ import annotations

import logging
import zlib

from ftrt.jobkeys import JobKeys
from ftrt.errors import StoreError, WatchCompacted
from ftrt.store.api import Compare, Delete, Get, Put, Store

log = logging.getLogger(__name__)

SLOTS = 16
"""Most candidates a job's election has at once."""


def slot_of(node_id: str) -> int:
    """The slot a node competes for (stable across its rejoins)."""
    return zlib.crc32(node_id.encode()) % SLOTS


class Election:
    """One agent's candidacy under one lease. :meth:`campaign` returns once it leads."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, lease_id: int, value: bytes) -> None:
        self.store = store
        self.lease_id = lease_id
        self.prefix = keys.election
        self.key = keys.election_slot(slot_of(node_id))
        self.value = value
        self.create_revision = 0
        """The slot key's create revision once this candidacy holds it (0 before)."""
        self.leader = False

    async def campaign(self) -> None:
        """Take the slot (waiting while another agent holds it), then return when every slot
        holder ahead has gone. Raises :class:`~ftrt.errors.LeaseLost` if the lease is gone,
        StoreError on etcd failures."""
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
