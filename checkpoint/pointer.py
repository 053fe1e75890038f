"""The job's ``latest`` checkpoint pointer in etcd, fenced by the rendezvous round.

Under ``ftrt launch``, rank 0 moves ``/ftrt/<job>/ckpt/latest`` after writing a manifest, in a
transaction that succeeds only while the round key is the one of the round its workers run in. A
worker of an older round (say, of a node that froze and thawed) therefore can never make its
checkpoint the latest; its manifest is withdrawn again. At restore, checkpoints newer than the
pointer are not trusted.

One exception: when the rounds after ours replaced it *without a fault* (nodes joined or drained;
the current round header's ``planned_since`` is ours or older), our workers are ending our round
at a step boundary on their agents' request, and the checkpoint of that step may still become the
latest: until the next round's workers start (its master record is absent, compared in the
transaction) and only if it is newer than the latest (``latest`` is compared too, so the pointer
never moves back).

:class:`LatestPointer` is the :class:`~ftrt.checkpoint.commit.CommitFence` a checkpointer of a
worker under ``ftrt launch`` commits through. The checkpointer's threads are synchronous: the
pointer's etcd calls run on a :class:`~ftrt.store.sync.SyncStore`, by default the one the worker
shares for all its etcd users (:meth:`ftrt.Runtime.etcd_store`).
"""

from __future__ import annotations

import json
import os
import time

from ftrt import envnames
from ftrt.errors import RoundChanged
from ftrt.jobkeys import JobKeys
from ftrt.records import RoundHeader, decode
from ftrt.store.access import EtcdTarget, target_from_env
from ftrt.store.api import Compare, Put
from ftrt.store.sync import SyncStore, shared


class LatestPointer:
    """Read and move one job's ``latest`` pointer, for checkpoints of round ``round_no`` under
    ``url``, through ``store`` (which the caller keeps open; :meth:`open` makes one the pointer
    owns)."""

    def __init__(self, store: SyncStore, job_id: str, round_no: int, url: str, *, own_store: bool = False) -> None:
        self.store = store
        self.keys = JobKeys(job_id)
        self.round_no = round_no
        """The round whose checkpoints this pointer commits (recorded in their manifests)."""
        self.url = url
        self._own_store = own_store

    @classmethod
    def open(cls, target: EtcdTarget, job_id: str, round_no: int, url: str, timeout: float = 5.0) -> "LatestPointer":
        """A pointer with an etcd connection of its own (closed by :meth:`close`)."""
        return cls(SyncStore(target, timeout=timeout, name="ftrt-pointer"), job_id, round_no, url, own_store=True)

    @property
    def key(self) -> str:
        return f"{self.keys.ckpt}latest"

    def _run(self, coro_fn):
        """Run ``coro_fn(store)`` on the store's loop; callers on any thread, one at a time each."""
        return self.store.call(coro_fn)

    def close(self) -> None:
        """Close the etcd connection if the pointer owns it (:meth:`open`). Idempotent."""
        if self._own_store:
            self.store.close()

    def _ours(self, header: RoundHeader | None) -> bool:
        """Whether ``header`` (the job's current round) lets our round commit: it is ours, or only
        planned changes replaced ours (our workers end our round at a step boundary)."""
        return header is not None and (header.round == self.round_no or (
            header.round > self.round_no and 0 < header.planned_since <= self.round_no))

    def check_round(self) -> None:
        """Raise :class:`RoundChanged` if our round may no longer commit (see :meth:`_ours`)."""

        async def go(store):
            kv, _ = await store.get(self.keys.round)
            header = decode(RoundHeader, kv.value) if kv else None
            if not self._ours(header):
                raise RoundChanged(
                    f"This worker runs in round {self.round_no} but the job is in round "
                    f"{header.round if header else 0}; its checkpoint is not committed."
                )

        self._run(go)

    def commit(self, step: int) -> None:
        """Point ``latest`` at ``step`` if our round may still commit (else :class:`RoundChanged`)."""

        async def go(store):
            kv, _ = await store.get(self.keys.round)
            header = decode(RoundHeader, kv.value) if kv else None
            if not self._ours(header):
                raise RoundChanged(
                    f"Round {self.round_no} was replaced by round {header.round if header else 0} before "
                    f"checkpoint step {step} could become the latest."
                )
            fence = [Compare.mod_revision(self.keys.round, kv.mod_revision)]
            if header.round != self.round_no:  # the boundary of a planned change: never move back,
                # and only before a later round's workers start (they publish its master record)
                fence += [Compare.mod_revision(self.keys.master(r), 0) for r in range(self.round_no + 1, header.round + 1)]
                latest, _ = await store.get(self.key)
                if latest is not None and json.loads(latest.value)["step"] >= step:
                    raise RoundChanged(f"Round {self.round_no} ended at step {step}, but the job's latest "
                                       f"checkpoint is already step {json.loads(latest.value)['step']}.")
                fence.append(Compare.mod_revision(self.key, latest.mod_revision if latest else 0))
            body = json.dumps({"step": step, "round": self.round_no, "url": self.url, "time": time.time()})
            res = await store.txn(fence, [Put(self.key, body.encode())])
            if not res.succeeded:
                raise RoundChanged(f"The round changed while checkpoint step {step} was being committed.")

        self._run(go)

    def latest(self) -> int | None:
        """The step ``latest`` points at, or None if no checkpoint was committed in this job."""

        async def go(store):
            kv, _ = await store.get(self.key)
            return json.loads(kv.value)["step"] if kv else None

        return self._run(go)


def job_pointer(url: str) -> LatestPointer | None:
    """The job's ``latest`` pointer for checkpoints under ``url``, fenced by this worker's round, on
    the process's shared etcd connection (:func:`ftrt.store.sync.shared`, the one
    :meth:`ftrt.Runtime.etcd_store` gives), when ``ftrt launch`` started this process (its
    environment names the job, the round and the job's etcd); else None."""
    target = target_from_env()
    job_id = os.environ.get(envnames.JOB_ID)
    if target is None or not job_id:
        return None
    return LatestPointer(shared(target), job_id, int(os.environ.get(envnames.ROUND) or 0), url)
