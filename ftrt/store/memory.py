"""An in-memory :class:`~ftrt.store.api.Store` for unit tests of pure logic.

It follows etcd's semantics (global revision, create/mod revisions, leases, ordered watches from a
revision) closely enough that the contract tests pass on it and on real etcd alike. Time comes from
an injected clock so lease expiry can be tested without sleeping; with the default clock a small
reaper task expires leases in real time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import AsyncIterator, Callable, Sequence

from ftrt.errors import LeaseLost, StoreUnavailable, WatchCompacted
from ftrt.store.api import (
    Compare,
    Delete,
    Get,
    KeyValue,
    Lease,
    Op,
    Put,
    TxnResult,
    WatchEvent,
    compare_holds,
)


class MemoryStore:
    """A single-process store with etcd's semantics. Not shared between processes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, reap_interval: float = 0.05):
        self._clock = clock
        self._real_clock = clock is time.monotonic
        self._reap_interval = reap_interval
        self._reaper: asyncio.Task | None = None
        self._kv: dict[str, KeyValue] = {}
        self._revision = 1
        self._history: list[WatchEvent] = []
        self._compacted = 0
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, deadline)
        self._lease_ids = itertools.count(0x1000)
        self._changed = asyncio.Condition()
        self._closed = False
        self.available = True
        """Set to False to make every call fail with StoreUnavailable (an outage in tests)."""

    # -- helpers -----------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise StoreUnavailable("The in-memory store is closed.")
        if not self.available:
            raise StoreUnavailable("The in-memory store is marked unavailable.")
        self._expire()

    def _ensure_reaper(self) -> None:
        if self._real_clock and self._reaper is None and not self._closed:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._reap_interval)
            if self._expire():
                await self._notify()

    def _expire(self) -> bool:
        now = self._clock()
        gone = [lid for lid, (_, deadline) in self._leases.items() if deadline <= now]
        for lid in gone:
            self._drop_lease(lid)
        return bool(gone)

    def _drop_lease(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        keys = [k for k, kv in self._kv.items() if kv.lease == lease_id]
        if keys:
            self._revision += 1
            for key in sorted(keys):
                self._delete_at(key, self._revision)

    def _delete_at(self, key: str, revision: int) -> bool:
        kv = self._kv.pop(key, None)
        if kv is None:
            return False
        self._history.append(WatchEvent("delete", key, b"", revision))
        return True

    def _put_at(self, key: str, value: bytes, lease: int, revision: int) -> None:
        if lease and lease not in self._leases:
            raise LeaseLost(f"Lease {lease:#x} does not exist (expired or revoked).")
        old = self._kv.get(key)
        kv = KeyValue(
            key=key,
            value=value,
            create_revision=old.create_revision if old else revision,
            mod_revision=revision,
            version=(old.version + 1) if old else 1,
            lease=lease,
        )
        self._kv[key] = kv
        self._history.append(
            WatchEvent("put", key, value, revision, create_revision=kv.create_revision, lease=lease)
        )

    def _range(self, key: str, prefix: bool) -> list[KeyValue]:
        if not prefix:
            kv = self._kv.get(key)
            return [kv] if kv else []
        return [self._kv[k] for k in sorted(self._kv) if k.startswith(key)]

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- Store protocol ----------------------------------------------------------------------
    async def get(self, key: str, *, timeout: float | None = None) -> tuple[KeyValue | None, int]:
        self._check()
        return self._kv.get(key), self._revision

    async def get_prefix(
        self, prefix: str, *, timeout: float | None = None
    ) -> tuple[list[KeyValue], int]:
        self._check()
        return self._range(prefix, True), self._revision

    async def last_created(
        self, prefix: str, max_create_revision: int, *, timeout: float | None = None
    ) -> tuple[KeyValue | None, int]:
        self._check()
        found = [kv for kv in self._range(prefix, True) if kv.create_revision <= max_create_revision]
        return max(found, key=lambda kv: kv.create_revision, default=None), self._revision

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None
    ) -> int:
        self._check()
        if lease and lease not in self._leases:
            raise LeaseLost(f"Lease {lease:#x} does not exist (expired or revoked).")
        self._revision += 1
        self._put_at(key, value, lease, self._revision)
        await self._notify()
        return self._revision

    async def delete(self, key: str, *, timeout: float | None = None) -> bool:
        self._check()
        if key not in self._kv:
            return False
        self._revision += 1
        self._delete_at(key, self._revision)
        await self._notify()
        return True

    async def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        self._check()
        keys = [kv.key for kv in self._range(prefix, True)]
        if not keys:
            return 0
        self._revision += 1
        for key in keys:
            self._delete_at(key, self._revision)
        await self._notify()
        return len(keys)

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        self._check()
        ok = all(compare_holds(self._kv.get(c.key), c) for c in compare)
        ops = success if ok else failure
        for op in ops:  # etcd rejects the whole txn if a put names a missing lease
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise LeaseLost(f"Lease {op.lease:#x} does not exist (expired or revoked).")
        writes = any(isinstance(op, (Put, Delete)) for op in ops)
        revision = self._revision + 1 if writes else self._revision
        results: list = []
        changed = False
        for op in ops:
            if isinstance(op, Put):
                self._put_at(op.key, op.value, op.lease, revision)
                changed = True
                results.append(None)
            elif isinstance(op, Delete):
                for kv in self._range(op.key, op.prefix):
                    changed |= self._delete_at(kv.key, revision)
                results.append(None)
            elif isinstance(op, Get):
                results.append(self._range(op.key, op.prefix))
        if changed:
            self._revision = revision
            await self._notify()
        return TxnResult(ok, self._revision, results)

    async def grant_lease(self, ttl: float, *, timeout: float | None = None) -> Lease:
        self._check()
        self._ensure_reaper()
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = (ttl, self._clock() + ttl)
        return Lease(lease_id, ttl)

    async def keep_alive(self, lease_id: int, *, timeout: float | None = None) -> float:
        self._check()
        if lease_id not in self._leases:
            raise LeaseLost(f"Lease {lease_id:#x} does not exist (expired or revoked).")
        ttl, _ = self._leases[lease_id]
        self._leases[lease_id] = (ttl, self._clock() + ttl)
        return ttl

    async def revoke_lease(self, lease_id: int, *, timeout: float | None = None) -> None:
        self._check()
        if lease_id in self._leases:
            self._drop_lease(lease_id)
            await self._notify()

    async def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[list[WatchEvent]]:
        if start_revision and start_revision <= self._compacted:
            raise WatchCompacted(
                f"Revision {start_revision} is compacted (compaction at {self._compacted}).",
                self._compacted,
            )
        # Like etcd, revision 0 means "from now on".
        last = (start_revision - 1) if start_revision else self._revision
        while True:
            async with self._changed:
                while True:
                    if self._closed:
                        return
                    batch = [
                        e for e in self._history if e.revision > last and e.key.startswith(prefix)
                    ]
                    if batch:
                        last = batch[-1].revision
                        break
                    await self._changed.wait()
            # Deliver one batch per revision, as etcd does.
            for _, group in itertools.groupby(batch, key=lambda e: e.revision):
                yield list(group)

    async def tick(self) -> None:
        """With an injected clock: expire the leases whose time has come and wake the watches, as
        the reaper does in real time with the default clock."""
        if self._expire():
            await self._notify()

    def compact(self, revision: int) -> None:
        """Forget history before ``revision`` (as etcd's compaction does)."""
        self._compacted = revision
        self._history = [e for e in self._history if e.revision >= revision]

    async def close(self) -> None:
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        await self._notify()
