"""The coordination store protocol: the small part of etcd's v3 API that ftrt relies on.

Two implementations follow it: :class:`ftrt.store.etcd.EtcdStore` on a real etcd cluster, and
:class:`ftrt.store.memory.MemoryStore` for unit tests of pure logic. One contract test suite
(``tests/store/test_contract.py``) runs against both.

Semantics follow etcd: every write bumps a global revision; a key remembers the revision that
created it and the one that last modified it; a key attached to a lease is deleted when the lease
expires or is revoked; a watch delivers every change after a given revision, in order.

Every call takes an optional ``timeout`` (seconds). When it is omitted the store's default
deadline applies; a call never waits forever. Calls raise :class:`~ftrt.errors.StoreUnavailable`
when the deadline passes without an answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Protocol, Sequence, Union, runtime_checkable


@dataclass(frozen=True)
class KeyValue:
    """A key with its value and its revisions, as the store returned it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch. ``value`` is empty for deletions."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int
    create_revision: int = 0
    lease: int = 0


@dataclass(frozen=True)
class Lease:
    """A granted lease: its id and the TTL the server granted (seconds)."""

    id: int
    ttl: float


CompareTarget = Literal["value", "mod", "create", "version", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """A condition of a transaction, on one key.

    ``target`` selects what is compared: the value (bytes), the mod or create revision, the version
    or the lease id (ints). An absent key has revisions, version and lease 0 and never equals a
    value.
    """

    key: str
    target: CompareTarget
    op: CompareOp
    operand: Union[bytes, int]

    @staticmethod
    def absent(key: str) -> "Compare":
        """The key does not exist."""
        return Compare(key, "create", "==", 0)

    @staticmethod
    def exists(key: str) -> "Compare":
        """The key exists."""
        return Compare(key, "create", ">", 0)

    @staticmethod
    def mod_revision(key: str, revision: int) -> "Compare":
        """The key was last modified at ``revision`` (0: the key is absent)."""
        return Compare(key, "mod", "==", revision)

    @staticmethod
    def value_is(key: str, value: bytes) -> "Compare":
        """The key exists and holds exactly ``value``."""
        return Compare(key, "value", "==", value)


@dataclass(frozen=True)
class Put:
    """Transaction operation: set ``key`` to ``value`` (attached to ``lease`` when non-zero)."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """Transaction operation: delete ``key``, or every key under it when ``prefix``."""

    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    """Transaction operation: read ``key``, or every key under it when ``prefix``."""

    key: str
    prefix: bool = False


Op = Union[Put, Delete, Get]


@dataclass
class TxnResult:
    """Outcome of a transaction.

    ``results`` has one entry per executed operation: for a :class:`Get` the list of key-values
    found, for a :class:`Put` or :class:`Delete` ``None``.
    """

    succeeded: bool
    revision: int
    results: list = field(default_factory=list)


@runtime_checkable
class Store(Protocol):
    """What ftrt needs from a coordination store. See the module docstring for semantics."""

    async def get(self, key: str, *, timeout: float | None = None) -> tuple[KeyValue | None, int]:
        """Return the key (or ``None``) and the store revision the read observed."""

    async def get_prefix(
        self, prefix: str, *, timeout: float | None = None
    ) -> tuple[list[KeyValue], int]:
        """Return every key under ``prefix`` sorted by key, and the store revision observed."""

    async def last_created(
        self, prefix: str, max_create_revision: int, *, timeout: float | None = None
    ) -> tuple[KeyValue | None, int]:
        """The key under ``prefix`` created last at or before ``max_create_revision`` (None if
        none), and the store revision observed: one key read, however many keys the prefix holds
        (an election candidate's predecessor)."""

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None
    ) -> int:
        """Set a key; return the revision of the write."""

    async def delete(self, key: str, *, timeout: float | None = None) -> bool:
        """Delete a key; return whether it existed."""

    async def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        """Delete every key under ``prefix``; return how many were deleted."""

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        """Run ``success`` if every comparison holds, else ``failure``, atomically."""

    async def grant_lease(self, ttl: float, *, timeout: float | None = None) -> Lease:
        """Grant a lease of at least ``ttl`` seconds."""

    async def keep_alive(self, lease_id: int, *, timeout: float | None = None) -> float:
        """Renew a lease; return its new TTL. Raises :class:`~ftrt.errors.LeaseLost` if gone."""

    async def revoke_lease(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke a lease, deleting its keys. Revoking an unknown lease is not an error."""

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Yield batches of changes under ``prefix`` from ``start_revision`` on, in order.

        The iterator survives connection loss (it re-watches from the last revision it delivered)
        and ends only when the consumer stops iterating (``aclose()``) or the store is closed.
        It raises :class:`~ftrt.errors.WatchCompacted` when the history it needs is gone.
        """

    async def close(self) -> None:
        """Release connections and stop watches."""


def compare_holds(kv: KeyValue | None, cmp: Compare) -> bool:
    """Evaluate one comparison against a key's current state (used by the in-memory store)."""
    if cmp.target == "value":
        if kv is None:
            return cmp.op == "!="
        actual: bytes | int = kv.value
    else:
        actual = {
            "mod": kv.mod_revision if kv else 0,
            "create": kv.create_revision if kv else 0,
            "version": kv.version if kv else 0,
            "lease": kv.lease if kv else 0,
        }[cmp.target]
    operand = cmp.operand
    if cmp.op == "==":
        return actual == operand
    if cmp.op == "!=":
        return actual != operand
    if cmp.op == "<":
        return actual < operand  # type: ignore[operator]
    return actual > operand  # type: ignore[operator]
