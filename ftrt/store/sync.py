"""A store for synchronous code: one event loop on a daemon thread of its own, and one etcd
connection on it for the store's lifetime (one connection, and under etcd auth one
authentication, rather than one per call).

A worker's etcd users (the checkpoint pointer, the rollout fleet) run on threads that are not event
loops; they share one per etcd target (:func:`shared`; :meth:`ftrt.Runtime.etcd_store` gives the
job's). Coroutines that need the loop itself (the fleet's pump and gRPC channels) run on
:attr:`SyncStore.loop`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from ftrt.store.access import EtcdTarget
from ftrt.store.api import Store
from ftrt.store.etcd import EtcdStore

T = TypeVar("T")


class SyncStore:
    """An etcd :class:`~ftrt.store.api.Store` driven from synchronous code (see the module docstring).

    ``timeout`` bounds each etcd call; the connection opens on first use."""

    def __init__(self, target: EtcdTarget, *, timeout: float = 5.0, name: str = "ftrt-etcd") -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        """The loop every call runs on; coroutines that belong with the store's may run there too."""
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.store: Store = EtcdStore(target.endpoints, timeout=timeout, access=target.access)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[Store], Awaitable[T]], timeout: float | None = None) -> T:
        """``fn(store)`` on the loop, its result returned here."""

        async def go() -> T:
            return await fn(self.store)

        return self.run(go(), timeout)

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def close(self) -> None:
        """Close the etcd connection and stop the loop's thread. Idempotent."""
        if self.loop.is_closed():
            return
        try:
            self.run(self.store.close(), timeout=5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()


_SHARED: dict[EtcdTarget, SyncStore] = {}
_SHARED_LOCK = threading.Lock()


def shared(target: EtcdTarget) -> SyncStore:
    """This process's one store for ``target``, made on first use and kept for the process's life:
    its users share one connection. Never close it; a process that forks must not use its parent's."""
    with _SHARED_LOCK:
        store = _SHARED.get(target)
        if store is None or store.closed:
            store = _SHARED[target] = SyncStore(target)
        return store
