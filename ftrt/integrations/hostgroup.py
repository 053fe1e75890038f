"""The elastic worker group's driver side, whatever runs its node hosts (docs/ray.md).

A single-controller program makes a group of a worker class (``module:Class``), ``nproc_per_node``
workers on each node, and calls methods on all of them with the results gathered, as veRL's or
OpenRLHF's worker groups do. Underneath it is an ftrt job: a node host on each node
(:class:`~ftrt.integrations.ray.host.NodeHost`) runs the node's ftrt agent, whose workers
(:mod:`~ftrt.integrations.ray.worker`) hold the worker objects in one torch process group.

:class:`HostGroup` is that group over a :class:`Placement`: the actor system that starts a host on
a node and carries calls to it (Ray: :class:`ftrt.integrations.ray.ElasticGroup`; Monarch:
:class:`ftrt.integrations.monarch.MonarchGroup`). Every call to a host is a
``concurrent.futures.Future``; the placement says which of a host's failures mean its node is gone.

When a node dies, its survivors take the next round in place (ftrt's own detection, or the
placement's: a host that dies makes the group remove its node's record from etcd at once) and
run the call in flight again at the smaller world; the call returns as soon as every rank of the
newest round that ran it has answered, without waiting for the actor system to report the dead
host. A node without a host gets one at the next call (up to ``max_nodes``); ftrt admits its
workers at a step boundary, and from then on they run the calls too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import pickle
import secrets
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftrt.errors import FtrtError
from ftrt.integrations.ray import wire
from ftrt.integrations.ray.host import HostSpec

log = logging.getLogger(__name__)

NODE_CHECK_S = 1.0
"""How often a call looks for nodes without a host."""
MOVED_ON_CHECK_S = 0.5
"""How often a call whose newest round lacks replies checks whether the ranks that answered moved on."""


class GroupError(FtrtError):
    """A method failed on a worker (its traceback is in the message), or the group cannot run."""


@dataclass(frozen=True)
class CallResult:
    """What one call gave: the round that completed it, its world size, and each of its ranks'
    return value in rank order. ``missing``: ranks of that round whose reply was lost with their
    node after they ran the call (their value is None); ``replies``: every reply, also from ranks
    that answered in an earlier round."""

    round: int
    world_size: int
    values: tuple[Any, ...]
    missing: tuple[int, ...]
    replies: tuple[wire.Reply, ...]


@dataclass(frozen=True)
class Node:
    """A node a host may run on: the placement's key for it, its name in the ftrt job, and an
    address for log lines."""

    key: str
    name: str
    address: str


@dataclass(frozen=True)
class Gone:
    """What a host's failure means: its node is gone (``retry``: perhaps only for a moment, ask once more)."""

    why: str
    retry: bool = False


class Placement(Protocol):
    """Where hosts run and how calls reach them (one per actor system)."""

    def nodes(self) -> list[Node]:
        """The nodes that may take workers now."""

    def driver_address(self) -> str:
        """The driver's node address (the group's own etcd binds it, loopback only)."""

    def start(self, node: Node, spec: HostSpec) -> Any:
        """A host actor on ``node``, built from ``spec``."""

    def submit(self, actor: Any, method: str, *args: Any) -> Future:
        """``actor.method(*args)``, as a future."""

    def dumps(self, value: Any) -> bytes:
        """``value`` pickled as the actor system pickles arguments (cloudpickle: lambdas and the
        driver's own classes too)."""

    def gone(self, exc: BaseException) -> Gone | None:
        """What ``exc`` from a host call means: its node is gone, or None (not the host's loss)."""

    def kill(self, actor: Any) -> None:
        """Stop ``actor`` for good (it may be gone already)."""

    def forget(self, node: Node) -> None:
        """``node`` left the group: offer it no more (a node that comes back is offered anew)."""


@dataclass
class _Host:
    node: Node
    node_id: str
    actor: Any
    in_job: bool = False


@dataclass
class HostGroup:
    """See the module docstring; subclasses give the placement (:meth:`_placement`).

    Args:
        worker: the worker class as ``module:Class``, importable on every node.
        nproc_per_node: workers per node.
        min_nodes, max_nodes: the job's node range (``max_nodes`` None: the nodes there are now).
        args, kwargs: what each worker object is built with.
        etcd: the job's etcd (``HOST:PORT``); None starts one for the group on the driver's node
            (only where that node's address is loopback: elsewhere give a secured etcd).
        job_id: the ftrt job's id (default: a new one).
        launch_args: more ``ftrt launch`` flags for every node's agent (default ``--lease-ttl 3``; given ones
            replace it).
        env: more environment for the agents and workers.
        ready_timeout: seconds the group may take to start.
        etcd_access: the driver's access to a secured ``etcd`` (:class:`ftrt.store.access.EtcdAccess`):
            the group removes a lost node's record itself.
    """

    worker: str
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    etcd: str | None = None
    job_id: str = field(default_factory=lambda: f"ray-{secrets.token_hex(4)}")
    launch_args: tuple[str, ...] = ("--lease-ttl", "3")
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 300.0
    etcd_access: Any = None

    def _placement(self) -> Placement:
        raise NotImplementedError

    def __post_init__(self) -> None:
        self._etcd_server = None
        self._hosts: dict[str, _Host] = {}
        self._dropped: list[_Host] = []
        self._strays: dict[Future, _Host] = {}
        """Calls the group stopped waiting for (their round completed, or the job moved on, without
        them): a host that died is dropped when its call fails."""
        self._seq = 0
        self._checked_at = 0.0
        self.round = 0
        self.world_size = 0
        self.placement = self._placement()
        try:
            if self.etcd is None:
                self._start_etcd()
            nodes = self.placement.nodes()
            if self.max_nodes is None:
                self.max_nodes = max(len(nodes), self.min_nodes)
            if len(nodes) < self.min_nodes:
                raise GroupError(f"The cluster has {len(nodes)} node(s) that can take workers; the group needs at "
                                 f"least min_nodes={self.min_nodes}. Add nodes or lower min_nodes.")
            for node in nodes[: self.max_nodes]:
                self._start_host(node)
            self._wait_in_job(len(self._hosts))
        except BaseException:
            self.close()
            raise

    def _start_etcd(self) -> None:
        from ftrt.store.etcd_server import EtcdServer

        host = self.placement.driver_address()
        if not ipaddress.ip_address(host).is_loopback:
            raise GroupError(f"The driver's node address is {host}, so the group's own etcd would serve the "
                             "network without TLS or users. Give etcd= the endpoints of a secured etcd (ftrt "
                             "etcd --tls DIR --etcd-user ...) and its client flags in launch_args.")
        self._etcd_server = EtcdServer(host=host)
        self._etcd_server.start()
        self.etcd = self._etcd_server.endpoint

    # -- nodes ----------------------------------------------------------------------------------
    def _start_host(self, node: Node) -> None:
        node_id = node.name
        init = wire.Init(self.worker, self._pickle((tuple(self.args), dict(self.kwargs))))
        spec = HostSpec(self.job_id, node_id, self.etcd, self.min_nodes, self.max_nodes, self.nproc_per_node,
                        init, tuple(self.launch_args), dict(self.env))
        self._hosts[node.key] = _Host(node, node_id, self.placement.start(node, spec))
        log.info("node host for node %s (%s) started", node_id, node.address)

    def _grow(self) -> None:
        """Hosts for nodes that have none, up to ``max_nodes`` (at most every NODE_CHECK_S)."""
        now = time.monotonic()
        if now - self._checked_at < NODE_CHECK_S:
            return
        self._checked_at = now
        for node in self.placement.nodes():
            if len(self._hosts) >= self.max_nodes:
                return
            if node.key not in self._hosts:
                self._start_host(node)

    def _reap(self) -> None:
        """Drop the hosts whose calls the group stopped waiting for and that failed since (for good:
        an error the placement says may pass is left to the next call to ask again)."""
        for fut in [f for f in self._strays if f.done()]:
            host = self._strays.pop(fut)
            exc = fut.exception()
            gone = self.placement.gone(exc) if exc is not None else None
            if gone is not None and not gone.retry and self._hosts.get(host.node.key) is host:
                self._lost(host.node.key, gone.why)

    def _lost(self, key: str, why: str) -> None:
        """A host died with its node, or its agent exited: drop the host, and its node from the
        job at once (its record in etcd) instead of waiting for its lease to run out."""
        host = self._hosts.pop(key)
        self._dropped.append(host)
        self.placement.forget(host.node)
        # A host taken for gone that still runs (unreachable for a while) must not keep an agent
        # beside the next host on its node; stopping a dead one may take the actor system a while.
        threading.Thread(target=self._kill_quietly, args=(host.actor,), name="ftrt-kill-host", daemon=True).start()
        log.warning("node %s left the group (%s); the group goes on without it", host.node_id, why)
        from ftrt.jobkeys import JobKeys
        from ftrt.store.etcd import EtcdStore

        async def drop() -> None:
            store = EtcdStore(self.etcd, timeout=5.0, **({"access": self.etcd_access} if self.etcd_access else {}))
            try:
                await store.delete(JobKeys(self.job_id).node(host.node_id))
            finally:
                await store.close()

        def run() -> None:  # in a thread of its own: the driver may run an event loop itself
            try:
                asyncio.run(drop())
            except FtrtError as exc:
                log.warning("could not drop node %s from etcd (%s); its lease runs out instead", host.node_id, exc)

        t = threading.Thread(target=run, name="ftrt-drop-node")
        t.start()
        t.join()

    def _kill_quietly(self, actor: Any) -> None:
        try:
            self.placement.kill(actor)
        except Exception:  # noqa: BLE001 - gone already
            pass

    def _wait_in_job(self, hosts: int) -> None:
        """Block until ``hosts`` hosts' workers are all in one round (or fail with their agents' words)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            states = self._statuses(max(1.0, deadline - time.monotonic()))
            for host, st in zip(self._hosts.values(), states):
                if st["agent_exit"] is not None:
                    tail = self.placement.submit(host.actor, "log_tail").result(timeout=30)
                    raise GroupError(f"The ftrt agent of node {st['node_id']} exited with code {st['agent_exit']} "
                                     f"while the group started; its last lines:\n{tail}")
            places = [w["place"] for st in states for w in st["workers"] if w["ready"]]
            rounds = {p.round for p in places}
            if len(states) == hosts and len(places) == hosts * self.nproc_per_node and len(rounds) == 1 \
                    and places[0].world_size == len(places):
                self.round, self.world_size = places[0].round, places[0].world_size
                for h in self._hosts.values():
                    h.in_job = True
                log.info("elastic group %s ready: %d workers on %d nodes, round %d", self.job_id,
                         self.world_size, hosts, self.round)
                return
            if time.monotonic() > deadline:
                raise GroupError(f"The group was not ready after {self.ready_timeout:g} s: {len(places)} of "
                                 f"{hosts * self.nproc_per_node} workers in the job (rounds {sorted(rounds)}).")
            time.sleep(0.2)

    def _statuses(self, timeout: float) -> list[dict]:
        futs = [self.placement.submit(h.actor, "status") for h in self._hosts.values()]
        _, late = wait(futs, timeout=timeout)
        if late:
            raise GroupError(f"The group's node hosts did not start within {self.ready_timeout:g} s "
                             "(ready_timeout); see the cluster's state (ray status).")
        try:
            return [f.result() for f in futs]
        except Exception as exc:  # noqa: BLE001 - a host that died while the group started
            raise GroupError(f"A node host failed while the group started: {str(exc).splitlines()[0]}") from None

    # -- calls ----------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, **kwargs: Any) -> CallResult:
        """Run ``method(*args, **kwargs)`` on every worker and gather the replies. A node lost during
        the call makes its survivors run it again at the smaller world; a method that fails on a
        worker raises :class:`GroupError` with its traceback."""
        self._reap()
        self._grow()
        if not self._hosts:
            raise GroupError("Every node of the group is gone.")
        self._seq += 1
        seq = self._seq
        payload = self._pickle((args, kwargs))
        pending = {self.placement.submit(h.actor, "call", seq, method, payload): key for key, h in self._hosts.items()}
        replies: list[wire.Reply] = []
        cancelled = False
        asked_again: set[str] = set()
        while pending:
            complete = _complete(replies)
            in_job = [k for k in pending.values() if k in self._hosts and self._hosts[k].in_job]
            if complete or not in_job:
                # Every rank of the newest round answered (the hosts still pending have no rank in it:
                # joining, or gone without the actor system having said so yet), or every host in the
                # job answered: a joining host's workers ran the call only if that round admitted them.
                if not cancelled:
                    cancelled = True
                    for key in pending.values():
                        if key in self._hosts and not self._hosts[key].in_job:
                            self.placement.submit(self._hosts[key].actor, "cancel", seq)
                if complete:
                    break
            done, _ = wait(list(pending), timeout=MOVED_ON_CHECK_S, return_when=FIRST_COMPLETED)
            if not done:
                if replies and self._moved_on(set(pending.values()), max(r.place.round for r in replies)):
                    # The ranks that answered are in a newer round and will not run this call again
                    # (a method without collectives, or one they got through before the fault): the
                    # hosts still pending (gone, or frozen and left behind) answer no more.
                    break
                continue
            for fut in done:
                key = pending.pop(fut)
                exc = fut.exception()
                if exc is None:
                    got = fut.result()
                    if got and key in self._hosts:
                        self._hosts[key].in_job = True
                    replies.extend(got)
                    continue
                gone = self.placement.gone(exc)
                if gone is None:
                    raise exc
                if key not in self._hosts:
                    continue
                if gone.retry and key not in asked_again:  # for a moment (a connection restarts): ask again
                    asked_again.add(key)
                    pending[self.placement.submit(self._hosts[key].actor, "call", seq, method, payload)] = key
                    continue
                self._lost(key, gone.why)
        for fut, key in pending.items():  # given up: the host stops holding the call, and may be found gone later
            if key in self._hosts:
                self.placement.submit(self._hosts[key].actor, "cancel", seq)
                self._strays[fut] = self._hosts[key]
        failed = [r for r in replies if not r.ok]
        if failed:
            first = min(failed, key=lambda r: r.place.rank)
            raise GroupError(f"{method} failed on rank {first.place.rank} (pid {first.pid}):\n{first.error}")
        if not replies:
            raise GroupError(f"No worker ran {method}: every node of the group is gone"
                             + (f" ({self._why_gone()})" if self._dropped else "") + ".")
        last = max(r.place.round for r in replies)
        final = {r.place.rank: r for r in replies if r.place.round == last}
        world = next(iter(final.values())).place.world_size
        self.round, self.world_size = last, world
        values = tuple(pickle.loads(final[k].value) if k in final else None for k in range(world))
        missing = tuple(k for k in range(world) if k not in final)
        if missing:
            log.warning("call %s: the replies of rank(s) %s of round %d were lost with their node", method,
                        list(missing), last)
        return CallResult(last, world, values, missing, tuple(replies))

    def _moved_on(self, pending: set[str], last: int) -> bool:
        """Whether the job is in a round newer than ``last`` (the newest round among the call's
        replies) whose ranks are all on hosts other than the ``pending`` ones: those hosts are left
        behind (gone, or frozen), and the ranks that answered will not run this call again."""
        others = [h for k, h in self._hosts.items() if k not in pending]
        states = self._status_of(others, MOVED_ON_CHECK_S)
        if len(states) < len(others):
            return False
        places = [w["place"] for st in states.values() for w in st["workers"] if w["ready"] and w["place"]]
        newer = {p.round: p.world_size for p in places if p.round > last}
        return any(sum(p.round == r for p in places) == size for r, size in newer.items())

    def _status_of(self, hosts: list[_Host], timeout: float) -> dict[str, dict]:
        """The status of each of ``hosts`` that answers within ``timeout`` (node key -> status)."""
        futs = {self.placement.submit(h.actor, "status"): h.node.key for h in hosts}
        done, _ = wait(list(futs), timeout=timeout)
        return {futs[f]: f.result() for f in done if f.exception() is None}

    def _pickle(self, value: Any) -> bytes:
        """``value`` as the workers receive it (:meth:`Placement.dumps`)."""
        try:
            return self.placement.dumps(value)
        except Exception as exc:  # noqa: BLE001 - say which value, in one line
            raise GroupError(f"The group cannot send {type(value).__name__} {value!r:.200}: {exc}") from None

    def _why_gone(self) -> str:
        return f"dropped: {', '.join(h.node_id for h in self._dropped)}"

    def status(self, timeout: float = 30.0) -> list[dict]:
        """Each live host's status (:meth:`NodeHost.status`); a host found gone is dropped, and one
        that does not answer within ``timeout`` (frozen) is left out."""
        self._reap()
        futs = {self.placement.submit(h.actor, "status"): key for key, h in self._hosts.items()}
        done, late = wait(list(futs), timeout=timeout)
        if late:
            log.warning("node host(s) %s did not answer within %g s", [self._hosts[futs[f]].node_id for f in late
                                                                        if futs[f] in self._hosts], timeout)
        states = []
        for fut in [f for f in futs if f in done]:
            key, exc = futs[fut], fut.exception()
            if exc is None:
                states.append(fut.result())
                continue
            gone = self.placement.gone(exc)
            if gone is None:
                raise exc
            if key in self._hosts and not gone.retry:
                self._lost(key, gone.why)
        return states

    def close(self, timeout: float = 60.0) -> None:
        """Finish the workers, end the job and stop the hosts (and the group's own etcd)."""
        hosts = self._hosts
        placement = getattr(self, "placement", None)
        if placement is not None:
            stops = [placement.submit(h.actor, "stop", timeout) for h in hosts.values()]
            for fut in stops:
                try:
                    fut.result(timeout=timeout + 10)
                except Exception as exc:  # noqa: BLE001 - a host that cannot stop is killed below
                    log.warning("a node host did not stop cleanly: %s", str(exc).splitlines()[0] if str(exc) else exc)
            for h in [*hosts.values(), *self._dropped]:
                try:
                    placement.kill(h.actor)
                except Exception:  # noqa: BLE001 - gone already
                    pass
        hosts.clear()
        self._dropped.clear()
        self._strays.clear()
        if self._etcd_server is not None:
            self._etcd_server.stop()
            self._etcd_server = None

    def __enter__(self) -> "HostGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _complete(replies: list[wire.Reply]) -> bool:
    """Whether the newest round among ``replies`` has a reply from each of its ranks."""
    if not replies:
        return False
    last = max(r.place.round for r in replies)
    final = {r.place.rank for r in replies if r.place.round == last}
    return len(final) == next(r.place.world_size for r in replies if r.place.round == last)
