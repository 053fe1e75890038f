"""Who may change a job's state over gRPC: a caller that shows the job's token.

The one owner of the job token, shared by the agents' service and the rollout servers. Every agent
RPC that writes (today ``PutReplica``) requires the job's credentials, as do a rollout server's
pushes and generation; the read-only
ones (``Health``, ``Status``, ``Liveness``) answer anyone who reaches the port, since ``ftrt
status`` and peers' death detection need nothing else. The token is 32 random bytes that the
first agent of a job creates in etcd (an atomic create-if-absent, so concurrent first agents
agree) and every agent reads when it joins. It is exactly as secret as the job's etcd keys:
whoever can read etcd can act as an agent of the job (docs/security.md). Callers send it as gRPC
metadata ``authorization: Bearer <token>``; the service compares in constant time and answers
UNAUTHENTICATED, having changed nothing, to a caller without it.

:data:`WRITES` lists the RPCs that need it; a test holds the service to that list, so an RPC
added later is either listed here or shown to be read-only.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from ftrt.jobkeys import JobKeys
from ftrt.errors import StoreError
from ftrt.store.api import Compare, Get, Put, Store

METADATA_KEY = "authorization"
WRITES = frozenset({"PutReplica"})
"""The agent RPCs that change state and so require the job's token."""
READS = frozenset({"Health", "Status", "Liveness"})
"""The agent RPCs open to any caller (they change nothing)."""


@dataclass(frozen=True)
class JobToken:
    """The job's shared secret, and how a call shows it."""

    value: str

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata that shows the token."""
        return ((METADATA_KEY, f"Bearer {self.value}"),)

    def allows(self, metadata) -> bool:
        """Whether a call's ``invocation_metadata()`` shows this token."""
        shown = next((v for k, v in (metadata or ()) if k == METADATA_KEY), "")
        expected = f"Bearer {self.value}"
        return hmac.compare_digest(shown.encode() if isinstance(shown, str) else bytes(shown), expected.encode())


async def require_token(token: JobToken, context, message: str) -> None:
    """Abort the gRPC call ``context`` with UNAUTHENTICATED and ``message`` unless it shows ``token``."""
    if not token.allows(context.invocation_metadata()):
        import grpc

        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


async def job_token(store: Store, keys: JobKeys, *, timeout: float = 5.0) -> JobToken:
    """The job's token: created in etcd if this is the first agent to ask, else the one there."""
    fresh = secrets.token_hex(32).encode()
    res = await store.txn([Compare.absent(keys.token)], [Put(keys.token, fresh)], [Get(keys.token)],
                          timeout=timeout)
    if res.succeeded:
        return JobToken(fresh.decode())
    found = res.results[0]
    if not found:
        raise StoreError(f"The job's token at {keys.token} vanished while it was read; start the agent again.")
    return JobToken(found[0].value.decode())


__all__ = ["JobToken", "METADATA_KEY", "READS", "WRITES", "job_token", "require_token"]
