"""Node registration under the agent's lease: create once, refuse duplicates, update fenced.

:class:`Membership` holds the lease and the registration of one agent and joins anew after a lost
lease.

A node key is created only if absent (a transaction), so two live agents can never both hold a
node id. An update compares the key's lease with ours, so an agent that lost its lease can never
overwrite the record of whoever registered the id after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from typing import Callable

from ftrt.store.concurrency import Session
from ftrt.errors import LeaseLost, NodeIdConflict, StoreError
from ftrt.jobkeys import JobKeys
from ftrt.records import NodeRecord, decode, encode
from ftrt.store.api import Compare, Get, Put, Store


class Taken(Exception):
    """The node id is registered by another lease; ``holder`` is its record."""

    def __init__(self, holder: NodeRecord) -> None:
        super().__init__(holder.node_id)
        self.holder = holder


async def register(store: Store, keys: JobKeys, record: NodeRecord, lease_id: int) -> NodeRecord:
    """Create this node's key; raise :class:`Taken` if another agent holds the id."""
    key = keys.node(record.node_id)
    res = await store.txn(
        [Compare.absent(key)], [Put(key, encode(record), lease=lease_id), Get(key)], [Get(key)]
    )
    if not res.succeeded:
        kv = res.results[0][0]
        raise Taken(dataclasses.replace(decode(NodeRecord, kv.value), lease=kv.lease, revision=kv.create_revision))
    kv = res.results[1][0]
    return dataclasses.replace(record, lease=lease_id, revision=kv.create_revision)


async def update(store: Store, keys: JobKeys, record: NodeRecord, lease_id: int) -> None:
    """Rewrite this node's record; raise :class:`LeaseLost` if the key is no longer ours."""
    key = keys.node(record.node_id)
    res = await store.txn(
        [Compare(key, "lease", "==", lease_id), Compare.exists(key)],
        [Put(key, encode(record), lease=lease_id)],
    )
    if not res.succeeded:
        raise LeaseLost(f"The registration of node {record.node_id!r} is no longer held by this agent.")


async def tcp_refused(addr: str, timeout: float = 0.5) -> bool:
    """True when ``host:port`` actively refuses connections (the process there is gone)."""
    host, _, port = addr.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


class Membership:
    """This node's membership: a lease kept alive (:class:`~ftrt.store.concurrency.Session`) and the
    node record registered under it. Each :meth:`join` is a new incarnation under a new lease; before
    the first, :meth:`registration` is None."""

    def __init__(self, store: Store, keys: JobKeys, *, node_id: str, host: str, agent_addr: str, nproc: int,
                 lease_ttl: float, on_renew: Callable[[float], None], log: logging.LoggerAdapter | logging.Logger
                 ) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.host = host
        self.agent_addr = agent_addr
        self.nproc = nproc
        self.lease_ttl = lease_ttl
        self.on_renew = on_renew
        self.log = log
        self.session: Session | None = None
        """The current lease (None before the first join)."""
        self.record: NodeRecord | None = None
        """The current registration (None before the first join)."""
        self._updating = asyncio.Lock()

    def registration(self) -> tuple[int, str] | None:
        """The live lease and incarnation (the rendezvous campaigns under them); None without."""
        if self.session is None or self.record is None or self.session.expired():
            return None
        return self.session.lease_id, self.record.incarnation

    def expired(self) -> bool:
        return self.session is None or self.session.expired()

    async def join(self, *, ready: bool) -> NodeRecord:
        """Take a new lease and register this node under it (a new incarnation). A registration
        still held by a dead agent, or by this agent's own earlier lease, is taken over; one held by
        a live agent is a :class:`~ftrt.errors.NodeIdConflict`."""
        session = await Session(self.store, self.lease_ttl, on_renew=self.on_renew).start()
        try:
            record = await self._register(session, ready)
        except BaseException:
            await session.close()  # a join that failed leaves no lease renewing behind
            raise
        # Published together: registration() never pairs a new lease with an old incarnation.
        self.session, self.record = session, record
        return record

    async def _register(self, session: Session, ready: bool) -> NodeRecord:
        rec = NodeRecord(
            node_id=self.node_id, incarnation=uuid.uuid4().hex[:12], host=self.host, agent_addr=self.agent_addr,
            nproc=self.nproc, ready=ready, pid=os.getpid(), started=time.time(),
        )
        try:
            return await register(self.store, self.keys, rec, session.lease_id)
        except Taken as taken:
            holder = taken.holder
            if holder.pid == os.getpid() and holder.agent_addr == self.agent_addr:
                # Our own earlier registration: a rejoin whose lease we gave up for lost although
                # etcd still holds it. Drop it and register again.
                self.log.warning("node id %s is still held by this agent's previous lease; replacing it",
                                 self.node_id)
            elif not await tcp_refused(holder.agent_addr):
                raise NodeIdConflict(
                    f"Node id {self.node_id!r} is already held in job {self.keys.job_id!r} by a live agent "
                    f"(pid {holder.pid} at {holder.agent_addr}). Give this agent another --node-id."
                ) from None
            else:
                self.log.warning("node id %s was held by a dead agent (pid %d at %s); taking it over",
                                 self.node_id, holder.pid, holder.agent_addr)
            await self.store.revoke_lease(holder.lease)
            return await register(self.store, self.keys, rec, session.lease_id)

    async def update(self, **changes) -> None:
        """Rewrite the node record (e.g. ``ready=True``); a lost registration is logged, not raised.
        Updates run one at a time, each on the record the one before wrote: none undoes another's."""
        async with self._updating:
            if self.record is None or self.session is None:
                return
            new = dataclasses.replace(self.record, **changes)
            try:
                await update(self.store, self.keys, new, self.session.lease_id)
                self.record = new
            except (LeaseLost, StoreError) as exc:
                self.log.warning("could not update this node's record: %s", exc)

    async def records(self) -> list[NodeRecord]:
        """Every node record of the job, as etcd holds them now (one read; records that do not
        parse are left out). Raises :class:`~ftrt.errors.StoreError` when etcd does not answer."""
        kvs, _ = await self.store.get_prefix(self.keys.nodes)
        out = []
        for kv in kvs:
            try:
                out.append(decode(NodeRecord, kv.value, lease=kv.lease, revision=kv.create_revision))
            except (ValueError, TypeError) as exc:
                self.log.warning("ignoring the node record %s: %s", kv.key, exc)
        return out

    def lost_reason(self) -> str:
        """Why the lease was lost, as far as the keep-alive knows ("" if it does not)."""
        return self.session.lost_reason if self.session is not None else ""

    def orphan(self) -> None:
        """Stop renewing the lease (fencing): it expires on its own."""
        if self.session is not None:
            self.session.orphan()

    async def close(self) -> None:
        """Revoke the lease: the registration goes at once."""
        if self.session is not None:
            await self.session.close()
