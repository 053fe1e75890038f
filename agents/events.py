"""The job's event log in etcd (``/ftrt/<job>/events/``), read by ``ftrt status``.

Agents record membership changes, failures and recoveries here as JSON. Writing an event never
blocks the caller's fault handling: :meth:`EventLog.emit` schedules the write and returns, and a
failed write is only logged. The log is trimmed to the newest ``keep`` entries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from ftrt.agents.keys import JobKeys
from ftrt.errors import StoreError
from ftrt.store.api import Store

log = logging.getLogger(__name__)


class EventLog:
    """Appends events for one node of a job."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, keep: int = 500) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.keep = keep
        self._count = 0
        self._pending: set[asyncio.Task] = set()

    def emit(self, kind: str, message: str, **fields) -> None:
        """Record an event in the background."""
        now = time.time()
        body = {"time": now, "node": self.node_id, "kind": kind, "message": message, **fields}
        key = f"{self.keys.events}{time.time_ns():020d}-{self.node_id}"
        task = asyncio.get_running_loop().create_task(self._write(key, body))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, key: str, body: dict) -> None:
        try:
            await self.store.put(key, json.dumps(body).encode(), timeout=2.0)
            self._count += 1
            if self._count % 50 == 0:
                await self._trim()
        except StoreError as exc:
            log.debug("could not record event %s: %s", body.get("kind"), exc)

    async def _trim(self) -> None:
        kvs, _ = await self.store.get_prefix(self.keys.events, timeout=2.0)
        for kv in kvs[: max(0, len(kvs) - self.keep)]:
            await self.store.delete(kv.key, timeout=2.0)

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait (bounded) for scheduled writes, e.g. before the agent exits."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout)


async def recent_events(store: Store, keys: JobKeys, limit: int = 20) -> list[dict]:
    """The newest ``limit`` events, oldest first."""
    kvs, _ = await store.get_prefix(keys.events)
    out = []
    for kv in kvs[-limit:]:
        try:
            out.append(json.loads(kv.value))
        except ValueError:
            continue
    return out
