"""Who may call a job's agents over gRPC: a caller that shows the job's token.

The one owner of the job token, shared by the agents' service and the rollout servers. Every agent
RPC that writes (``PutReplica``) or tells about the job (``Status``: its nodes, workers' pids and
steps; ``Liveness``: the beats a peer's death detection follows) requires the job's credentials,
as do a rollout server's pushes and generation. Only ``Health`` answers anyone who reaches the
port, for probes (a load balancer's, Kubernetes'). ``ftrt status`` reads the token from etcd
with the credentials it reads the job's keys with. The token is 32 random bytes that the first
agent of a job creates in etcd (an atomic create-if-absent, so concurrent first agents agree)
and every agent reads when it joins. It is exactly as secret as the job's etcd keys: whoever can
read etcd can act as an agent of the job (docs/security.md). Callers send it as gRPC metadata
``authorization: Bearer <token>``; the service compares in constant time and answers
UNAUTHENTICATED, having told and changed nothing, to a caller without it.

:data:`GUARDED` lists the RPCs that need it and :data:`OPEN` the others; a test holds the service
to these lists, so an RPC added later is classified on purpose.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Callable

from ftrt.jobkeys import JobKeys
from ftrt.errors import StoreError
from ftrt.store.api import Compare, Get, Put, Store

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
GUARDED = frozenset({"PutReplica", "Status", "Liveness"})
"""The agent RPCs that require the job's token: those that change state, and those that tell about
the job or feed a peer's death detection."""
OPEN = frozenset({"Health"})
"""The agent RPCs open to any caller: a probe's (job, node, round, state, uptime)."""


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


class RefusalLog:
    """Log lines for calls refused for want of the token: one per caller host and call every
    ``every`` seconds, with the count of those left out since (a flood must not flood the log)."""

    def __init__(self, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def note(self, peer: str, call: str) -> None:
        host, _, port = peer.rpartition(":")  # "ipv4:127.0.0.1:5123": the caller's host, without its port
        host = host if host and port.isdigit() else peer
        key, now = (host, call), self.clock()
        last, skipped = self._last.get(key, (-1e18, 0))
        if now - last < self.every:
            self._last[key] = (last, skipped + 1)
            return
        if len(self._last) >= 1024:  # many hosts: forget the quiet ones rather than grow without bound
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every}
        self._last[key] = (now, 0)
        log.warning("refused %s from %s: it did not show the job's token%s", call, host,
                    f" ({skipped} more refused since the last line)" if skipped else "")


REFUSALS = RefusalLog()
"""This process's refusal log lines (:func:`require_token`)."""


async def require_token(token: JobToken, context, message: str, call: str = "a call") -> None:
    """Abort the gRPC call ``context`` with UNAUTHENTICATED and ``message`` unless it shows
    ``token``; a refusal is logged (:class:`RefusalLog`), naming ``call`` and the caller's host."""
    if not token.allows(context.invocation_metadata()):
        import grpc

        REFUSALS.note(context.peer() or "an unknown caller", call)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


async def read_token(store: Store, keys: JobKeys, *, timeout: float = 5.0) -> JobToken | None:
    """The job's token as its agents created it in etcd, or None when no agent has started yet
    (for callers that are not agents: ``ftrt status``, the chaos suite)."""
    kv, _ = await store.get(keys.token, timeout=timeout)
    return JobToken(kv.value.decode()) if kv is not None else None


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


__all__ = ["GUARDED", "JobToken", "METADATA_KEY", "OPEN", "job_token", "read_token", "require_token"]
