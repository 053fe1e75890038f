"""The job's ``latest`` checkpoint pointer in etcd, fenced by the rendezvous round.

Under ``ftrt launch``, rank 0 moves ``/ftrt/<job>/ckpt/latest`` after writing a manifest, in a
transaction that succeeds only while the round key is the one of the round its workers run in. A
worker of an older round (say, of a node that froze and thawed) therefore can never make its
checkpoint the latest; its manifest is withdrawn again. At restore, checkpoints newer than the
pointer are not trusted.

The checkpointer's threads are synchronous, so each call runs a short event loop of its own.
"""

from __future__ import annotations

import asyncio
import json
import time

from ftrt.agents.keys import JobKeys
from ftrt.agents.records import RoundRecord, decode
from ftrt.errors import RoundChanged
from ftrt.store.access import EtcdAccess
from ftrt.store.api import Compare, Put
from ftrt.store.etcd import EtcdStore


class LatestPointer:
    """Read and move one job's ``latest`` pointer (``access``: the agent's etcd credentials)."""

    def __init__(self, endpoints: str, job_id: str, round_no: int, url: str, timeout: float = 5.0,
                 access: EtcdAccess = EtcdAccess()) -> None:
        self.endpoints = endpoints
        self.access = access
        self.keys = JobKeys(job_id)
        self.round_no = round_no
        self.url = url
        self.timeout = timeout

    @property
    def key(self) -> str:
        return f"{self.keys.ckpt}latest"

    def _run(self, coro_fn):
        async def go():
            store = EtcdStore(self.endpoints, timeout=self.timeout, access=self.access)
            try:
                return await coro_fn(store)
            finally:
                await store.close()

        return asyncio.run(go())

    def check_round(self) -> None:
        """Raise :class:`RoundChanged` if the job's round is no longer ours."""

        async def go(store):
            kv, _ = await store.get(self.keys.round)
            current = decode(RoundRecord, kv.value).round if kv else 0
            if current != self.round_no:
                raise RoundChanged(
                    f"This worker runs in round {self.round_no} but the job is in round {current}; "
                    "its checkpoint is not committed."
                )

        self._run(go)

    def commit(self, step: int) -> None:
        """Point ``latest`` at ``step`` if our round is still current (else :class:`RoundChanged`)."""

        async def go(store):
            kv, _ = await store.get(self.keys.round)
            current = decode(RoundRecord, kv.value).round if kv else 0
            if kv is None or current != self.round_no:
                raise RoundChanged(
                    f"Round {self.round_no} was replaced by round {current} before checkpoint step "
                    f"{step} could become the latest."
                )
            body = json.dumps({"step": step, "round": self.round_no, "url": self.url, "time": time.time()})
            res = await store.txn(
                [Compare.mod_revision(self.keys.round, kv.mod_revision)], [Put(self.key, body.encode())]
            )
            if not res.succeeded:
                raise RoundChanged(f"The round changed while checkpoint step {step} was being committed.")

        self._run(go)

    def latest(self) -> int | None:
        """The step ``latest`` points at, or None if no checkpoint was committed in this job."""

        async def go(store):
            kv, _ = await store.get(self.key)
            return json.loads(kv.value)["step"] if kv else None

        return self._run(go)
