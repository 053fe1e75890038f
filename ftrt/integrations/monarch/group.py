"""The elastic worker group on Monarch process meshes (``torchmonarch``; docs/ray.md, "Monarch").

:class:`MonarchGroup` is :class:`ftrt.integrations.hostgroup.HostGroup` with its node hosts as
Monarch actors (:class:`~ftrt.integrations.monarch.host.MonarchHost`), each alone in a process mesh
of one process on its host. A host's process that dies is a node lost: Monarch's supervision fails
the calls in flight to it (and tells the fault hook), and the group drops the node from the job.
ftrt's own detection (the dead agent's liveness stream) usually ends the round first; Monarch's
comes after its supervision poll (``supervision_poll``, 9 s by Monarch's default; the group sets
it lower). The workers are ftrt's processes under the node's agent, as on Ray, not Monarch actors.

Monarch's default fault hook exits the driver when any mesh fails; the group replaces it with one
that logs the failure. At :meth:`~HostGroup.close` a hook the driver set itself is given back;
Monarch's default is not (a late report must not end the program).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ftrt.integrations.hostgroup import Gone, HostGroup, Node
from ftrt.integrations.ray.host import HostFailed, HostSpec

log = logging.getLogger(__name__)

POLL_ENV = "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"
"""Monarch's supervision poll (read when its runtime starts in this process)."""


@dataclass
class _Handle:
    mesh: Any
    actor: Any


class MonarchPlacement:
    """Node hosts on Monarch: one single-process mesh per host of ``hosts`` (Monarch host meshes;
    the same host more than once gives several nodes on it)."""

    def __init__(self, hosts: list[Any]) -> None:
        import monarch.actor as ma

        self._ma = ma
        self._nodes: list[Node] = []
        self._hosts: dict[str, Any] = {}
        self._added = 0
        self.failures: list[tuple[float, str]] = []
        """Each mesh failure Monarch reported to this driver: (``time.monotonic()``, its first line)."""
        for host in hosts:
            self.add(host)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ftrt-monarch")
        self._saved_hook = ma.unhandled_fault_hook
        ma.unhandled_fault_hook = self._fault  # Monarch's own exits the driver

    def add(self, host: Any) -> Node:
        """One more node, on ``host`` (it gets a node host at the group's next call)."""
        key = f"m{self._added}-{secrets.token_hex(3)}"
        self._added += 1
        node = Node(key, f"monarch-{key}", "127.0.0.1")
        self._nodes.append(node)
        self._hosts[key] = host
        return node

    def _fault(self, failure: Any) -> None:
        line = str(failure).splitlines()[0]
        self.failures.append((time.monotonic(), line))
        log.warning("Monarch reports a failed mesh: %s", line)

    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def driver_address(self) -> str:
        return "127.0.0.1"

    def start(self, node: Node, spec: HostSpec) -> _Handle:
        from ftrt.integrations.monarch.host import MonarchHost

        mesh = self._hosts[node.key].spawn_procs(per_host={"procs": 1})
        return _Handle(mesh, mesh.spawn("ftrt_host", MonarchHost, spec))

    def submit(self, actor: _Handle, method: str, *args: Any) -> Future:
        try:
            fut = getattr(actor.actor, "stop_host" if method == "stop" else method).call_one(*args)
        except Exception as exc:  # noqa: BLE001 - raised at once (a mesh known dead): the call's outcome
            failed: Future = Future()
            failed.set_exception(exc)
            return failed
        return self._pool.submit(fut.get)

    def dumps(self, value: Any) -> bytes:
        import cloudpickle

        return cloudpickle.dumps(value)

    def gone(self, exc: BaseException) -> Gone | None:
        text = str(exc)
        if type(exc).__name__ == "SupervisionError":
            return Gone("its host's process died: " + text.splitlines()[-1].strip())
        if isinstance(exc, HostFailed) or "HostFailed" in text:
            return Gone(next((ln for ln in text.splitlines() if "agent of node" in ln), text.splitlines()[0]))
        return None

    def kill(self, actor: _Handle) -> None:
        try:
            actor.mesh.stop().get(timeout=30)
        except Exception:  # noqa: BLE001 - gone already
            pass

    def forget(self, node: Node) -> None:
        """A lost host's process is not started again on its own (a crash loop would follow): the
        driver adds a node back with :meth:`MonarchGroup.add_node`."""
        self._nodes = [n for n in self._nodes if n.key != node.key]
        self._hosts.pop(node.key, None)

    def close(self) -> None:
        """Give back the driver's own fault hook. Monarch's default one, which exits the driver, is
        not put back: a failure reported after the group closed (a host killed shortly before, with
        a slow supervision poll) must not end the program."""
        if not getattr(self._saved_hook, "__module__", "").startswith("monarch"):
            self._ma.unhandled_fault_hook = self._saved_hook
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class MonarchGroup(HostGroup):
    """:class:`~ftrt.integrations.hostgroup.HostGroup` on Monarch.

    Args (besides the group's):
        nodes: how many nodes on this host (``this_host()``), when ``hosts`` is not given.
        hosts: Monarch host meshes, one node each (a multi-host job's hosts).
        supervision_poll: Monarch's supervision poll for this process (e.g. ``"200ms"``), set before
            Monarch's runtime starts here; None leaves Monarch's (9 s by default).
    """

    nodes: int = 2
    hosts: list[Any] = field(default_factory=list)
    supervision_poll: str | None = "200ms"

    def _placement(self) -> MonarchPlacement:
        if self.supervision_poll is not None:
            os.environ.setdefault(POLL_ENV, self.supervision_poll)
        from monarch.actor import this_host

        return MonarchPlacement(self.hosts or [this_host()] * self.nodes)

    def add_node(self, host: Any = None) -> None:
        """A node more on ``host`` (default: this host): it joins at a step boundary after the next call."""
        from monarch.actor import this_host

        self.placement.add(host if host is not None else this_host())
        self._checked_at = 0.0

    def close(self, timeout: float = 60.0) -> None:
        try:
            super().close(timeout)
        finally:
            if getattr(self, "placement", None) is not None:
                self.placement.close()
