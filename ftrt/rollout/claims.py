"""Weight versions bound to their trainer: the trainer claims each version's digest in etcd before
it pushes it, and a rollout server applies a push only if its version and digest are claimed.

A push reaches a server from anyone who shows the job's token. Its digest
(:func:`~ftrt.rollout.weights.digest_of`, SHA-256 over every tensor's SHA-256) names its bytes
exactly, so the trainer writes ``rollout/versions`` (every version it may still push, with its
digest) under a lease it keeps alive (:class:`VersionClaims`) and pushes a version only once that
write is done; a server reads the key when a push has arrived whole and refuses one that it does
not list (:func:`check`, :func:`judge`), with a log line, keeping the versions it had. So a
server never holds a version its trainer did not make, even from a caller who has the token.
With etcd closed (:mod:`ftrt.store.access`), only the job's own processes can write the claims.
A trainer that dies takes its claims with its lease; the versions its servers hold stay, and a
new trainer claims its own before it pushes them.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Mapping

from ftrt.errors import StoreError
from ftrt.jobkeys import JobKeys
from ftrt.store.api import Store
from ftrt.store.concurrency import Session

log = logging.getLogger(__name__)

LEASE_TTL = 10.0
"""Seconds the trainer's claims outlive it."""

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def encode(versions: Mapping[int, str]) -> bytes:
    return json.dumps({"versions": {str(v): d for v, d in sorted(versions.items())}}).encode()


def decode(raw: bytes) -> dict[int, str]:
    """The claimed versions (ValueError: not a claim record)."""
    body = json.loads(raw)
    versions = body.get("versions") if isinstance(body, dict) else None
    if not isinstance(versions, dict):
        raise ValueError("not a record of weight versions")
    out = {}
    for v, d in versions.items():
        if not str(v).isdigit() or not isinstance(d, str) or not _DIGEST.fullmatch(d):
            raise ValueError(f"version {str(v)[:20]!r} with digest {str(d)[:20]!r}")
        out[int(v)] = d
    return out


def judge(claimed: Mapping[int, str] | None, version: int, digest: str) -> str | None:
    """Why a push of ``version`` with ``digest`` must be refused, or None to apply it."""
    if claimed is None:
        return "the trainer claims no weight version in etcd (none made yet, or it is gone with its lease)"
    want = claimed.get(version)
    if want is None:
        return (f"the trainer made no version {version} (it claims "
                f"{', '.join(map(str, sorted(claimed))) or 'none'})")
    if want != digest:
        return f"version {version}'s digest is {digest[:12]}, but the trainer's is {want[:12]}: the weights were changed"
    return None


async def check(store: Store, keys: JobKeys, version: int, digest: str) -> str | None:
    """:func:`judge` against the claims in etcd now; a claim that cannot be read refuses too."""
    try:
        kv, _ = await store.get(keys.rollout_versions, timeout=5.0)
        return judge(decode(kv.value) if kv is not None else None, version, digest)
    except StoreError as exc:
        return f"the trainer's claims could not be read from etcd ({exc})"
    except ValueError as exc:
        return f"the trainer's claims in etcd are malformed ({exc})"


class VersionClaims:
    """The trainer's claims (see the module docstring), under a lease of its own.

    Built by :meth:`start`; :meth:`publish` writes the versions it may push now.
    """

    def __init__(self, store: Store, keys: JobKeys, session: Session) -> None:
        self.store = store
        self.keys = keys
        self.session = session
        self.claimed: dict[int, str] = {}
        """What etcd holds, as last written."""

    @classmethod
    async def start(cls, store: Store, keys: JobKeys, ttl: float = LEASE_TTL) -> "VersionClaims":
        return cls(store, keys, await Session(store, ttl).start())

    async def publish(self, versions: Mapping[int, str]) -> None:
        """Claim exactly ``versions`` (version -> digest). Raises StoreError when etcd cannot take
        it; a lease that ran out is replaced first."""
        if self.session.expired():
            log.warning("the lease of the trainer's weight claims ran out (%s); taking another",
                        self.session.lost_reason or "not renewed in time")
            self.session.orphan()
            self.session = await Session(self.store, self.session.ttl).start()
        await self.store.put(self.keys.rollout_versions, encode(versions), lease=self.session.lease_id, timeout=5.0)
        self.claimed = dict(versions)

    def lapsed(self) -> bool:
        """Whether the claims may be gone from etcd (their lease ran out or was lost): they are
        written again before any push."""
        return self.session.expired()

    def forget(self) -> None:
        """A server found no claim of ours: write them again before the next push."""
        self.claimed = {}

    async def close(self) -> None:
        """Stop renewing and revoke the lease: the claims go at once."""
        await self.session.close()


__all__ = ["LEASE_TTL", "VersionClaims", "check", "decode", "encode", "judge"]
