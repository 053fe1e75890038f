"""A lease plus its keep-alive: the agent's membership in the job.

Modelled on etcd's ``concurrency.Session``: :meth:`Session.start` grants the lease and renews it
every TTL/3; :attr:`Session.lost` fires when the lease is gone (revoked, expired) or could not be
renewed before it ran out. :meth:`orphan` stops renewing and lets it expire; :meth:`close`
revokes it.

``valid_until`` is the latest local monotonic time at which the lease is surely still alive on
the server (the send time of the last successful renewal plus the TTL the server granted). The
agent fences itself (stops its workers) when that time passes without a renewal, and publishes it
to its workers through the fence file so they stop themselves even if the agent is frozen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ftrt.errors import LeaseLost, StoreError
from ftrt.store.api import Store

log = logging.getLogger(__name__)


class Session:
    """A lease kept alive in the background. See the module docstring."""

    def __init__(
        self,
        store: Store,
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_renew: Callable[[float], None] | None = None,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.clock = clock
        self.on_renew = on_renew
        self.lease_id = 0
        self.granted_ttl = 0.0
        self.valid_until = 0.0
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._task: asyncio.Task | None = None

    async def start(self) -> "Session":
        sent = self.clock()
        lease = await self.store.grant_lease(self.ttl)
        self.lease_id, self.granted_ttl = lease.id, lease.ttl
        self._renewed(sent + lease.ttl)
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="lease-keepalive")
        return self

    def _renewed(self, valid_until: float) -> None:
        self.valid_until = valid_until
        if self.on_renew is not None:
            self.on_renew(valid_until)

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()

    async def _keep_alive(self) -> None:
        interval = max(0.1, self.granted_ttl / 3)
        next_at = self.clock() + interval
        while not self.lost.is_set():
            await asyncio.sleep(max(0.0, next_at - self.clock()))
            remaining = self.valid_until - self.clock()
            if remaining <= 0:
                self._lose(
                    f"lease {self.lease_id:#x} could not be renewed within its {self.granted_ttl:g} s TTL"
                )
                return
            sent = self.clock()
            try:
                ttl = await asyncio.wait_for(
                    self.store.keep_alive(self.lease_id, timeout=remaining), timeout=remaining
                )
            except LeaseLost as exc:
                self._lose(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a renewal that failed in any way is retried until
                # the lease runs out; a keep-alive task that died of a surprise would fence the node later
                # without a word (an etcd leader loss once ended one that way)
                why = str(exc) or (f"no answer within {remaining:.2f} s" if isinstance(exc, asyncio.TimeoutError)
                                   else type(exc).__name__)
                log.warning("lease renewal failed (%s); %.2f s of lease left", why, self.valid_until - self.clock())
                next_at = self.clock() + min(0.1, interval)
                continue
            took = self.clock() - sent
            if took > interval:
                log.warning("lease renewal took %.2f s (%.2f s of lease were left)", took, remaining)
            # A renewal that returns after the lease ran out locally does not un-fence us.
            if self.clock() >= self.valid_until:
                self._lose(f"lease {self.lease_id:#x} ran out before its renewal returned")
                return
            self._renewed(sent + ttl)
            next_at = sent + interval

    def expired(self) -> bool:
        """Whether the lease may be gone on the server (local view; no I/O)."""
        return self.lost.is_set() or self.clock() >= self.valid_until

    def orphan(self) -> None:
        """Stop renewing; the lease expires by itself after its TTL."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        """Stop renewing and revoke the lease (its keys vanish at once)."""
        self.orphan()
        if self.lease_id and not self.lost.is_set():
            try:
                await self.store.revoke_lease(self.lease_id, timeout=2.0)
            except StoreError as exc:
                log.warning("could not revoke lease %#x: %s", self.lease_id, exc)
        self._lose("session closed")
