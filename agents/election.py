"""The decider election: one agent of a job decides its rounds, chosen as etcd's own
``concurrency.Election`` chooses a leader.

Each candidate puts a key under ``/ftrt/<job>/election/`` bound to its lease (its create revision
is its place in the queue) and waits until no key created before its own is left: it reads its
*predecessor* (the key created last before its own: one key read, however many candidates there
are) and watches that one key until it is deleted, then looks again. The first in the queue leads.
When the leader dies, its lease takes its key away and only its successor is woken: there is no
herd of agents racing a create-if-absent on one key, which at thousands of nodes was thousands of
transactions for every decider change.

A leader's writes carry :meth:`Election.fence`: its key still exists with the same create
revision, so a leader whose lease is gone can no longer write, even if it still believes it leads.
"""

from __future__ import annotations

import logging

from ftrt.jobkeys import JobKeys
from ftrt.errors import StoreError, WatchCompacted
from ftrt.store.api import Compare, Delete, Get, Put, Store

log = logging.getLogger(__name__)


class Election:
    """One agent's candidacy under one lease. :meth:`campaign` returns once it leads."""

    def __init__(self, store: Store, keys: JobKeys, lease_id: int, value: bytes) -> None:
        self.store = store
        self.lease_id = lease_id
        self.prefix = keys.election
        self.key = keys.candidate(lease_id)
        self.value = value
        self.create_revision = 0
        """The candidate key's create revision (0 until it is put)."""
        self.leader = False

    async def campaign(self) -> None:
        """Join the queue (once) and return when every candidate ahead has gone. Raises
        :class:`~ftrt.errors.LeaseLost` if the lease is gone, StoreError on etcd failures."""
        if not self.create_revision:
            res = await self.store.txn([Compare.absent(self.key)], [Put(self.key, self.value, lease=self.lease_id)],
                                       [Get(self.key)])
            self.create_revision = res.revision if res.succeeded else res.results[0][0].create_revision
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
