"""An elastic, in-place worker group for single-controller Ray programs (docs/ray.md).

The driver makes an :class:`ElasticGroup` of a worker class (``module:Class``), ``nproc_per_node``
workers on each Ray node, and calls methods on all of them with the results gathered, as veRL's
or OpenRLHF's worker groups do. Underneath it is an ftrt job: a node host on each Ray node
(:mod:`~ftrt.integrations.ray.host`) runs the node's ftrt agent, whose workers
(:mod:`~ftrt.integrations.ray.worker`) hold the worker objects in one torch process group.

When a Ray node dies, Ray tells the driver at once (the node's host actor dies); the group removes
the node's record from the job's etcd, so the job's next round is decided without waiting for the
node's lease to run out. The surviving workers take that round in place, their processes and
state kept, and run the call in flight again at the smaller world: :meth:`ElasticGroup.call`
returns it. A node added to the Ray cluster gets a host at the next call (up to ``max_nodes``);
ftrt admits its workers at a step boundary, and from then on they run the calls too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import pickle
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ftrt.errors import FtrtError
from ftrt.integrations.ray import wire
from ftrt.integrations.ray.host import HostFailed, HostSpec, NodeHost

log = logging.getLogger(__name__)

NODE_CHECK_S = 1.0
"""How often a call looks for Ray nodes without a host."""


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


@dataclass
class _Host:
    node_id: str
    actor: Any
    in_job: bool = False


@dataclass
class ElasticGroup:
    """See the module docstring.

    Args:
        worker: the worker class as ``module:Class``, importable on every node.
        nproc_per_node: workers per Ray node.
        min_nodes, max_nodes: the job's node range (``max_nodes`` None: the nodes there are now).
        args, kwargs: what each worker object is built with.
        etcd: the job's etcd (``HOST:PORT``); None starts one for the group on the driver's node
            (only where that node's address is loopback: elsewhere give a secured etcd).
        job_id: the ftrt job's id (default: a new one).
        launch_args: more ``ftrt launch`` flags for every node's agent (default ``--lease-ttl 3``; given ones
            replace it).
        env: more environment for the agents and workers.
        ready_timeout: seconds the group may take to start.
        node_filter: which Ray nodes get workers (default: alive nodes with a CPU).
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
    node_filter: Any = None
    etcd_access: Any = None

    def __post_init__(self) -> None:
        import ray

        self._ray = ray
        self._host_cls = None
        self._etcd_server = None
        if self.etcd is None:
            from ftrt.store.etcd_server import EtcdServer

            host = ray.util.get_node_ip_address()
            if not ipaddress.ip_address(host).is_loopback:
                raise GroupError(f"The driver's node address is {host}, so the group's own etcd would serve the "
                                 "network without TLS or users. Give etcd= the endpoints of a secured etcd (ftrt "
                                 "etcd --tls DIR --etcd-user ...) and its client flags in launch_args.")
            self._etcd_server = EtcdServer(host=host)
            self._etcd_server.start()
            self.etcd = self._etcd_server.endpoint
        nodes = self._eligible()
        if self.max_nodes is None:
            self.max_nodes = max(len(nodes), self.min_nodes)
        if len(nodes) < self.min_nodes:
            self.close()
            raise GroupError(f"The Ray cluster has {len(nodes)} node(s) that can take workers; the group needs at "
                             f"least min_nodes={self.min_nodes}. Add nodes or lower min_nodes.")
        self._hosts: dict[str, _Host] = {}
        self._dropped: list[_Host] = []
        self._seq = 0
        self._checked_at = 0.0
        self.round = 0
        self.world_size = 0
        try:
            for node in nodes[: self.max_nodes]:
                self._start_host(node)
            self._wait_in_job(len(self._hosts))
        except BaseException:
            self.close()
            raise

    # -- nodes ----------------------------------------------------------------------------------
    def _eligible(self) -> list[dict]:
        accept = self.node_filter or (lambda n: n["Resources"].get("CPU", 0) >= 1)
        return [n for n in self._ray.nodes() if n["Alive"] and accept(n)]

    def _start_host(self, node: dict) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray_id = node["NodeID"]
        node_id = f"ray-{ray_id[:12]}"
        init = wire.Init(self.worker, self._pickle((tuple(self.args), dict(self.kwargs))))
        spec = HostSpec(self.job_id, node_id, self.etcd, self.min_nodes, self.max_nodes, self.nproc_per_node,
                        init, tuple(self.launch_args), dict(self.env))
        if self._host_cls is None:
            self._host_cls = self._ray.remote(NodeHost)  # exported once: a join costs no export
        actor = self._host_cls.options(
            num_cpus=0, max_concurrency=16, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_id, soft=False)).remote(spec)
        self._hosts[ray_id] = _Host(node_id, actor)
        log.info("node host for Ray node %s (%s) started", node_id, node["NodeManagerAddress"])

    def _grow(self) -> None:
        """Hosts for Ray nodes that have none, up to ``max_nodes`` (at most every NODE_CHECK_S)."""
        now = time.monotonic()
        if now - self._checked_at < NODE_CHECK_S:
            return
        self._checked_at = now
        for node in self._eligible():
            if len(self._hosts) >= self.max_nodes:
                return
            if node["NodeID"] not in self._hosts:
                self._start_host(node)

    def _lost(self, ray_id: str, why: str) -> None:
        """A host died with its Ray node, or its agent exited: drop the host, and its node from the
        job at once (its record in etcd) instead of waiting for its lease to run out."""
        host = self._hosts.pop(ray_id)
        self._dropped.append(host)
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

    def _wait_in_job(self, hosts: int) -> None:
        """Block until ``hosts`` hosts' workers are all in one round (or fail with their agents' words)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                states = self._ray.get([h.actor.status.remote() for h in self._hosts.values()],
                                       timeout=max(1.0, deadline - time.monotonic()))
            except self._ray.exceptions.GetTimeoutError:
                raise GroupError(f"The group's node hosts did not start within {self.ready_timeout:g} s "
                                 "(ready_timeout); see the Ray cluster's state (ray status).") from None
            for host, st in zip(self._hosts.values(), states):
                if st["agent_exit"] is not None:
                    tail = self._ray.get(host.actor.log_tail.remote())
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

    # -- calls ----------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, **kwargs: Any) -> CallResult:
        """Run ``method(*args, **kwargs)`` on every worker and gather the replies. A node lost during
        the call makes its survivors run it again at the smaller world; a method that fails on a
        worker raises :class:`GroupError` with its traceback."""
        self._grow()
        if not self._hosts:
            raise GroupError("Every node of the group is gone.")
        self._seq += 1
        seq = self._seq
        payload = self._pickle((args, kwargs))
        pending = {self._hosts[rid].actor.call.remote(seq, method, payload): rid for rid in self._hosts}
        replies: list[wire.Reply] = []
        cancelled = False
        asked_again: set[str] = set()
        while pending:
            if not any(self._hosts[r].in_job for r in pending.values()):
                # Every host in the job has answered. A joining host's workers ran the call only if
                # the round that completed it admitted them; otherwise it need not be waited for.
                if not cancelled:
                    cancelled = True
                    for joining in pending.values():
                        self._hosts[joining].actor.cancel.remote(seq)
                if _complete(replies):
                    break
            done, _ = self._ray.wait(list(pending), num_returns=1)
            ref = done[0]
            rid = pending.pop(ref)
            try:
                got = self._ray.get(ref)
            except self._ray.exceptions.ActorUnavailableError:
                if rid in asked_again:  # unreachable twice: taken for gone
                    self._lost(rid, "its host stayed unreachable")
                    continue
                asked_again.add(rid)  # for a moment (Ray restarts a connection): ask it again
                pending[self._hosts[rid].actor.call.remote(seq, method, payload)] = rid
                continue
            except self._ray.exceptions.RayActorError as exc:
                self._lost(rid, f"its host died: {type(exc).__name__}")
                continue
            except HostFailed as exc:
                self._lost(rid, str(exc).splitlines()[0])
                continue
            if got and rid in self._hosts:
                self._hosts[rid].in_job = True
            replies.extend(got)
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

    def _pickle(self, value: Any) -> bytes:
        """``value`` as the workers receive it (cloudpickle: what Ray itself can carry)."""
        from ray import cloudpickle

        try:
            return cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - say which value, in one line
            raise GroupError(f"The group cannot send {type(value).__name__} {value!r:.200}: {exc}") from None

    def _why_gone(self) -> str:
        return f"dropped: {', '.join(h.node_id for h in self._dropped)}"

    def status(self) -> list[dict]:
        """Each host's status (:meth:`NodeHost.status`)."""
        return self._ray.get([h.actor.status.remote() for h in self._hosts.values()])

    def close(self, timeout: float = 60.0) -> None:
        """Finish the workers, end the job and stop the hosts (and the group's own etcd)."""
        hosts = getattr(self, "_hosts", {})
        stops = [h.actor.stop.remote(timeout) for h in hosts.values()]
        for ref in stops:
            try:
                self._ray.get(ref, timeout=timeout + 10)
            except Exception as exc:  # noqa: BLE001 - a host that cannot stop is killed below
                log.warning("a node host did not stop cleanly: %s", str(exc).splitlines()[0] if str(exc) else exc)
        for h in [*hosts.values(), *getattr(self, "_dropped", [])]:
            try:
                self._ray.kill(h.actor)
            except Exception:  # noqa: BLE001 - gone already
                pass
        hosts.clear()
        if getattr(self, "_dropped", None):
            self._dropped.clear()
        if self._etcd_server is not None:
            self._etcd_server.stop()
            self._etcd_server = None

    def __enter__(self) -> "ElasticGroup":
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
