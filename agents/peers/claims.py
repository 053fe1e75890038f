"""Memory replicas bound to their owner: each node claims in etcd what its checkpoints are, and a
peer stores a replica only if it matches its owner's claim.

A replica arrives over ``PutReplica`` from anyone who shows the job's token (and, with agent
mutual TLS, a certificate of the job's CA). That alone would let a caller who has the token store
a checkpoint "of node b" with any bytes and any step, which the survivors would restore after b's
loss (restore takes the newest step it finds). So:

- the sending agent, once it has read an arena and hashed it (SHA-256 over its index, then its
  bytes), writes a :class:`Claim` for it to ``memclaims/<node>/rank-<r>`` in etcd (the newest
  :data:`KEPT` claims of that rank), under its lease and only while its node's registration is
  under that lease (:class:`ClaimBook`), and then sends the stream's last message, the hash;
- the receiving agent, with every byte in hand, reads that key and stores the replica only if a
  claim there names exactly its step, round, world, size and hash (:func:`judge`); with mutual TLS,
  the caller's certificate must also name the source node (its id, or the host it registered
  with). Anything else is refused with the reason, logged and counted (:class:`ReplicaGate`).

So a replica on a node is one its owner made: with etcd closed (:mod:`ftrt.store.access`), only
the job's agents can write claims, and a holder of the token alone cannot make one up. The step a
restore takes from a replica is therefore one its owner's worker saved and its agent reported.
Replicas already stored live in folders only the user can read (:mod:`ftrt.privatefiles`), so a
check on arrival holds until restore. A claim goes with its node's lease, which is why it is
checked when the replica arrives (its owner is alive then) and not at restore (its owner may be
dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, NoReturn

from ftrt.errors import StoreError
from ftrt.jobkeys import JobKeys
from ftrt.store.api import Compare, Put, Store

log = logging.getLogger(__name__)

KEPT = 4
"""Claims kept per rank: a replica in flight to one peer while the next checkpoint's claim is
written for another still finds its own."""

MAX_STREAMS = 8
"""Replica streams a node takes at once. Each of its K replica predecessors sends one at a time,
so only a caller flooding it with streams (each a file on the node's tmpfs until it is checked)
meets this bound."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ReplicaRefused(ValueError):
    """A replica that does not match what its owner claimed (or came from a caller who is not its
    owner, or is older than the one held); nothing of it was stored."""


class ReplicaBusy(Exception):
    """A replica stream refused at its start: one of the same rank from the same node is already
    arriving, too many streams are, or it would not fit in the node's memory directory."""


@dataclass(frozen=True)
class Claim:
    """What one memory checkpoint of a rank is: enough to recognise its replica."""

    step: int
    round: int
    world: int
    size: int
    """Bytes of its arena."""
    sha256: str
    """SHA-256 of its index (as sent) followed by its arena's bytes, 64 hex digits."""

    def describe(self) -> str:
        return f"step {self.step} of round {self.round} (world {self.world}, {self.size} bytes, sha256 {self.sha256[:12]})"


def hasher(index_json: str) -> "hashlib._Hash":
    """A SHA-256 started on a replica's index; the arena's bytes follow (:attr:`Claim.sha256`)."""
    return hashlib.sha256(index_json.encode())


@dataclass(frozen=True)
class ClaimRecord:
    """A node's claims of one rank as stored in etcd."""

    node: str
    rank: int
    host: str
    """The host the node registered with (its agent's address), which its certificate names."""
    claims: tuple[Claim, ...]

    def encode(self) -> bytes:
        return json.dumps({"node": self.node, "rank": self.rank, "host": self.host,
                           "claims": [asdict(c) for c in self.claims]}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "ClaimRecord":
        """Parse and check a record (ValueError: not one)."""
        body = json.loads(raw)
        if not isinstance(body, dict) or not isinstance(body.get("claims"), list):
            raise ValueError("not a claim record")
        claims = []
        for c in body["claims"][-KEPT:]:  # the newest, as the writer keeps them
            if not isinstance(c, dict) or not _HEX64.fullmatch(str(c.get("sha256", ""))):
                raise ValueError("a claim without a SHA-256")
            fields = {k: c.get(k) for k in ("step", "round", "world", "size")}
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields.values()):
                raise ValueError(f"a claim with a bad field: {fields}")
            claims.append(Claim(sha256=c["sha256"], **fields))
        node, rank, host = body.get("node"), body.get("rank"), body.get("host")
        if not isinstance(node, str) or not isinstance(rank, int) or not isinstance(host, str):
            raise ValueError("a claim record without node, rank and host")
        return cls(node, rank, host, tuple(claims))


class ClaimBook:
    """The sending agent's claims (see the module docstring): per rank, the newest :data:`KEPT`.

    Args:
        store, keys: the job's etcd.
        node_id, host: this node, as registered.
        registration: the node's live lease and incarnation, or None while it holds none
            (:meth:`~ftrt.agents.rendezvous.membership.Membership.registration`).
    """

    def __init__(self, store: Store, keys: JobKeys, node_id: str, host: str,
                 registration: Callable[[], tuple[int, str] | None]) -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.host = host
        self.registration = registration
        self._claims: dict[int, tuple[int, list[Claim]]] = {}
        """Per rank: the lease its claims are written under, and the claims."""
        self._locks: dict[int, asyncio.Lock] = {}

    async def publish(self, rank: int, claim: Claim) -> None:
        """Claim ``claim`` for ``rank`` (a no-op when it is claimed already under the node's live
        lease). Raises :class:`~ftrt.errors.StoreError` when etcd cannot take it or this node holds
        no registration: the replica must not go then, as its receiver would refuse it."""
        reg = self.registration()
        if reg is None:
            raise StoreError(f"node {self.node_id} holds no registration, so it cannot claim its checkpoints")
        lease = reg[0]
        # One write at a time per rank: two links claiming two checkpoints of it at once would
        # each write the list without the other's.
        async with self._locks.setdefault(rank, asyncio.Lock()):
            written_under, held = self._claims.get(rank, (0, []))
            if written_under != lease:
                held = []  # the claims went with the lease they were written under
            if claim in held:
                return
            claims = [*(c for c in held if c != claim), claim][-KEPT:]
            record = ClaimRecord(self.node_id, rank, self.host, tuple(claims))
            node_key = self.keys.node(self.node_id)
            res = await self.store.txn([Compare(node_key, "lease", "==", lease), Compare.exists(node_key)],
                                       [Put(self.keys.mem_claim(self.node_id, rank), record.encode(), lease=lease)],
                                       timeout=5.0)
            if not res.succeeded:
                raise StoreError(f"node {self.node_id}'s registration is no longer under lease {lease:#x}; "
                                 "its claims wait for the next one")
            self._claims[rank] = (lease, claims)


def judge(source: str, rank: int, claim: Claim, record: ClaimRecord | None,
          cert_names: frozenset[str] | None) -> str | None:
    """Why a replica of ``source``'s rank ``rank`` that is ``claim`` must be refused, or None to
    store it. ``record`` is what ``source`` claimed for that rank (None: nothing); ``cert_names``
    the names in the caller's certificate (None: no mutual TLS)."""
    if record is None:
        return (f"node {source} claims no memory checkpoint of rank {rank} in etcd (it never made one, or "
                "its claims went with its lease)")
    if (record.node, record.rank) != (source, rank):
        return f"the claim record of node {source} rank {rank} names node {record.node} rank {record.rank}"
    if cert_names is not None and not {source, record.host} & cert_names:
        return (f"the caller's certificate names {', '.join(sorted(cert_names)) or 'nothing'}, neither node "
                f"{source} nor its host {record.host}: a node may only send its own checkpoints")
    if claim in record.claims:
        return None
    same = [c for c in record.claims if (c.step, c.round, c.world) == (claim.step, claim.round, claim.world)]
    if same:
        return (f"its {claim.describe()} is not what node {source} claimed for that step "
                f"({same[0].describe()}): the bytes or the index were changed")
    steps = ", ".join(str(c.step) for c in record.claims) or "none"
    return f"node {source} claimed steps {steps} of rank {rank}, not {claim.describe()}"


def cert_names(auth_context: Mapping[str, list[bytes]]) -> frozenset[str] | None:
    """The names (subject alternative names and common name) of a caller's verified certificate,
    from a gRPC call's auth context; None when the call is not over TLS."""
    if not auth_context.get("x509_pem_cert") and not auth_context.get("x509_common_name") and \
            not auth_context.get("x509_subject_alternative_name"):
        return None
    names = [*auth_context.get("x509_subject_alternative_name", []), *auth_context.get("x509_common_name", [])]
    return frozenset(n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names)


def _free_bytes(path: str) -> int:
    """Bytes free on the filesystem that holds ``path`` (or would: its nearest existing folder)."""
    at = Path(path)
    while not at.exists() and at.parent != at:
        at = at.parent
    return shutil.disk_usage(at).free


class ReplicaGate:
    """The receiving agent's check of every replica (:func:`judge`), with a count of refusals, and
    its bound on the streams arriving at once (:meth:`stream`)."""

    def __init__(self, store: Store, keys: JobKeys, max_streams: int = MAX_STREAMS) -> None:
        self.store = store
        self.keys = keys
        self.max_streams = max_streams
        self.refused = 0
        """Replicas refused since this agent started (not matching a claim, from a caller that is
        not their owner, older than the one held, or with their owner's claims unreadable)."""
        self._arriving: set[tuple[str, int]] = set()

    @contextlib.contextmanager
    def stream(self, source: str, rank: int, size: int, mem_dir: str) -> Iterator[None]:
        """Hold one arriving stream of ``source``'s rank ``rank`` (``size`` bytes), or raise
        :class:`ReplicaBusy`: its owner sends one at a time, and a node takes :data:`MAX_STREAMS`
        at once, none larger than what its memory directory has free."""
        if (source, rank) in self._arriving:
            raise ReplicaBusy(f"a replica of node {source}'s rank {rank} is already arriving; one at a time")
        if len(self._arriving) >= self.max_streams:
            raise ReplicaBusy(f"{len(self._arriving)} replica streams are arriving already; try again later")
        free = _free_bytes(mem_dir)
        if size > free:
            raise ReplicaBusy(f"the replica of node {source}'s rank {rank} ({size} bytes) does not fit in the "
                              f"{free} bytes free in this node's memory directory")
        self._arriving.add((source, rank))
        try:
            yield
        finally:
            self._arriving.discard((source, rank))

    def refuse(self, source: str, rank: int, claim: Claim, why: str) -> NoReturn:
        """Count and log a refusal, and raise :class:`ReplicaRefused`."""
        self.refused += 1
        log.warning("refused a memory replica said to be node %s's rank %d (%s): %s", source, rank,
                    claim.describe(), why)
        raise ReplicaRefused(f"The replica of node {source}'s rank {rank} was refused: {why}.")

    async def admit(self, source: str, rank: int, claim: Claim, auth_context: Mapping[str, list[bytes]]) -> None:
        """Return if the replica may be stored; raise :class:`ReplicaRefused` (logged, counted) if not."""
        try:
            kv, _ = await self.store.get(self.keys.mem_claim(source, rank), timeout=5.0)
            record = ClaimRecord.decode(kv.value) if kv is not None else None
            why = judge(source, rank, claim, record, cert_names(auth_context))
        except StoreError as exc:
            why = f"its owner's claims could not be read from etcd ({exc})"
        except ValueError as exc:
            why = f"node {source}'s claim record for rank {rank} is malformed ({exc})"
        if why is not None:
            self.refuse(source, rank, claim, why)


__all__ = ["Claim", "ClaimBook", "ClaimRecord", "KEPT", "MAX_STREAMS", "ReplicaBusy", "ReplicaGate", "ReplicaRefused",
           "cert_names", "hasher", "judge"]
