"""Node registration under the agent's lease: create once, refuse duplicates, update fenced.

A node key is created only if absent (a transaction), so two live agents can never both hold a
node id. An update compares the key's lease with ours, so an agent that lost its lease can never
overwrite the record of whoever registered the id after it.
"""

from __future__ import annotations

import asyncio
import dataclasses

from ftrt.jobkeys import JobKeys
from ftrt.records import NodeRecord, decode, encode
from ftrt.errors import LeaseLost
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
