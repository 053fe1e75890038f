"""The job's event log in etcd (``/ftrt/<job>/events/``), read by ``ftrt status``, and each
agent's own event file (``ftrt launch --event-log FILE``).

Agents record membership changes, failures and recoveries here as JSON: time, node, round, kind,
a sentence, and the kind's fields (the evidence of a fault, a restore's tier, step and seconds).
Writing an event never blocks the caller's fault handling: :meth:`EventLog.emit` appends the file
line (a local write) and schedules the etcd write, and a failed write is only logged. Frequent
events (checkpoint commits) go to the file only. The etcd log is trimmed to the newest ``keep``
entries; the file is the operator's to rotate.

Kinds: ``round`` (decided), ``decider``, ``node_lost`` (with its evidence), ``worker_failure``,
``worker_hang``, ``teardown_cut``, ``fenced``, ``workers_started``, ``workers_stopped``, ``restore``,
``checkpoint_committed``, ``node_done``, and the job's end (``succeeded``/``failed``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable, TextIO

from ftrt.jobkeys import JobKeys
from ftrt.errors import ConfigError, StoreError
from ftrt.store.api import Store

log = logging.getLogger(__name__)


def open_event_file(path: str) -> TextIO:
    """Open ``--event-log``'s file for appending, or say clearly why it cannot be."""
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--event-log {path} cannot be opened for appending ({exc.strerror}); give a writable "
                          "file path.") from exc


class EventLog:
    """Appends events for one node of a job."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, keep: int = 500, *,
                 file: TextIO | None = None, round_of: Callable[[], int] = lambda: 0) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.keep = keep
        self.file = file
        self.round_of = round_of
        self._count = 0
        self._pending: set[asyncio.Task] = set()

    def emit(self, kind: str, message: str, *, local: bool = False, **fields) -> None:
        """Record an event: in the event file now, in etcd in the background (``local``: the
        file only, for frequent events)."""
        now = time.time()
        body = {"time": now, "node": self.node_id, "round": fields.pop("round", None) or self.round_of(),
                "kind": kind, "message": message, **fields}
        if self.file is not None:
            try:
                self.file.write(json.dumps(body, separators=(",", ":")) + "\n")
                self.file.flush()
            except (OSError, ValueError) as exc:
                log.warning("could not write event %s to the event log: %s", kind, exc)
        if local:
            return
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
