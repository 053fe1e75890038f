"""The node host as a Monarch actor: :class:`~ftrt.integrations.ray.host.NodeHost` behind Monarch
endpoints, one per single-process mesh (:mod:`ftrt.integrations.monarch.group`).

The endpoints are coroutines that run the host's blocking methods in threads, so a call in flight
and its cancel, or a status asked meanwhile, are served at once, as the Ray actor's threads serve
them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from monarch.actor import Actor, endpoint

from ftrt.integrations.ray import wire
from ftrt.integrations.ray.host import HostSpec, NodeHost


class MonarchHost(Actor):
    """See the module docstring."""

    def __init__(self, spec: HostSpec) -> None:
        self._host = NodeHost(spec)

    @endpoint
    async def call(self, seq: int, method: str, payload: bytes) -> list[wire.Reply]:
        return await asyncio.to_thread(self._host.call, seq, method, payload)

    @endpoint
    async def cancel(self, seq: int) -> None:
        self._host.cancel(seq)

    @endpoint
    async def status(self) -> dict[str, Any]:
        return self._host.status()

    @endpoint
    async def log_tail(self, lines: int = 20) -> str:
        return self._host.log_tail(lines)

    @endpoint
    async def stop_host(self, timeout: float = 30.0) -> int | None:
        """NodeHost.stop (``stop`` is the actor mesh's own name)."""
        return await asyncio.to_thread(self._host.stop, timeout)
