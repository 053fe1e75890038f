"""The node host: one Ray actor per Ray node of an elastic group, which runs that node's ftrt agent
and relays the driver's calls to the agent's workers.

The host starts ``ftrt launch`` on its node (the node's agent, with ``--recovery in-place``):
everything ftrt does for a node happens there as under any launch (membership and rounds on etcd,
supervision, memory replicas, fencing). The agent's workers run
:mod:`ftrt.integrations.ray.worker` and connect back to the host over a Unix socket in the host's
private folder (:mod:`~ftrt.integrations.ray.wire`).

A call (:meth:`NodeHost.call`) goes to every worker of the node that is in the job, and returns
their replies once each has answered. A worker that joins while a call is in flight (its node
was just admitted, or it replaced a failed one) gets the call too: its peers run it in a round
that includes it. A host whose workers are not in the job yet holds the call until they are, or
until the driver says the call is complete without them (:meth:`NodeHost.cancel`).

The agent is started from a thread that lives as long as the agent, so the parent-death signal
the agent's children rely on fires when the host's process dies, and only then.
"""

from __future__ import annotations

import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from ftrt import envnames, tmpdirs
from ftrt.errors import FtrtError
from ftrt.integrations.ray import wire
from ftrt.procs import dying_with_this_process


class HostFailed(FtrtError):
    """The node's agent exited: its workers are gone (the job failed, or the node is leaving)."""


@dataclass(frozen=True)
class HostSpec:
    """What a node host runs: the job, this node's name in it, and the workers' class."""

    job_id: str
    node_id: str
    etcd: str
    min_nodes: int
    max_nodes: int
    nproc: int
    init: wire.Init
    launch_args: tuple[str, ...] = ()
    """More ``ftrt launch`` flags (e.g. ``--lease-ttl 2``)."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment for the agent and its workers."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "ftrt.cli.main", "launch", "--etcd", self.etcd, "--job-id", self.job_id,
                "--node-id", self.node_id, "--nnodes", f"{self.min_nodes}:{self.max_nodes}",
                "--nproc-per-node", str(self.nproc), "--recovery", "in-place", *self.launch_args,
                "-m", "ftrt.integrations.ray.worker"]


HANDSHAKE_S = 30.0
"""How long a worker that proved the key may take to say who it is."""


@dataclass
class _Link:
    """One worker's connection. What goes to the worker is queued and sent by a thread of its own,
    never under the host's lock: a worker busy in a collective does not read, and a large call
    must not stop the host meanwhile."""

    conn: Connection
    local_rank: int
    pid: int
    ready: bool = False
    place: wire.Place | None = None
    alive: bool = True
    sent: set[int] = field(default_factory=set)
    replies: dict[int, wire.Reply] = field(default_factory=dict)
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class NodeHost:
    """See the module docstring. Made a Ray actor by the group (``max_concurrency`` > 1: a call and
    its cancel run at the same time)."""

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.dir = tmpdirs.owned_dir("ftrt-ray-")  # removed by the next host here if this one is killed
        self.log_path = os.path.join(self.dir, "agent.log")
        key = secrets.token_bytes(wire.AUTH_BYTES)
        self._key = key
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(os.path.join(self.dir, "host.sock"))  # in a 0700 folder
        self._server.listen(64)
        self._cond = threading.Condition()
        self._links: dict[int, _Link] = {}
        """The newest connection of each local rank."""
        self._every: list[_Link] = []
        """Every connection, also those replaced or closed (a reply they gave still counts)."""
        self._current: wire.Call | None = None
        self._latest = 0
        """The newest call seen: an older one arriving late (Ray does not order a threaded actor's
        calls) was given up by the driver already."""
        self._cancelled: set[int] = set()
        self._agent_code: int | None = None
        self._closing = False
        env = {**os.environ, **spec.env, envnames.RAY_HOST_SOCKET: os.path.join(self.dir, "host.sock"),
               envnames.RAY_HOST_KEY: key.hex()}
        started = threading.Event()
        self._agent: subprocess.Popen | None = None
        threading.Thread(target=self._run_agent, args=(env, started), name="ftrt-agent", daemon=True).start()
        threading.Thread(target=self._accept, name="ftrt-accept", daemon=True).start()
        started.wait()

    # -- the agent ------------------------------------------------------------------------------
    def _run_agent(self, env: dict[str, str], started: threading.Event) -> None:
        code = -1
        try:
            with open(self.log_path, "ab") as log:
                self._agent = subprocess.Popen(dying_with_this_process(self.spec.command()), env=env, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd())
                started.set()
                code = self._agent.wait()  # this thread lives as long as the agent (its parent-death signal)
        except OSError as exc:
            with open(self.log_path, "a") as log:
                log.write(f"ftrt: could not start the agent: {exc}\n")
        finally:
            started.set()
        with self._cond:
            self._agent_code = code
            self._cond.notify_all()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the agent and its workers wrote."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _failed(self) -> HostFailed:
        return HostFailed(f"The ftrt agent of node {self.spec.node_id} exited with code {self._agent_code}; "
                          f"its last lines:\n{self.log_tail()}")

    # -- workers' connections -------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._server.accept()  # the handshake runs in the link's own thread
            except OSError:
                if self._closing:
                    return
                continue
            threading.Thread(target=self._serve_link, args=(sock,), name="ftrt-link", daemon=True).start()

    def _serve_link(self, sock) -> None:
        conn = Connection(sock.detach())  # a peer that stalls the handshake holds only this thread
        try:
            deliver_challenge(conn, self._key)  # authenticated both ways before anything is unpickled
            answer_challenge(conn, self._key)
            if not conn.poll(HANDSHAKE_S):
                raise TimeoutError("no hello")
            hello = conn.recv()
            if not isinstance(hello, wire.Hello):
                raise ValueError(f"a {type(hello).__name__} instead of a hello")
        except Exception:  # noqa: BLE001 - a peer without the key, a dead or silent one: only it is turned away
            conn.close()
            return
        link = _Link(conn, hello.local_rank, hello.pid)
        with self._cond:
            old = self._links.get(hello.local_rank)
            if old is not None:
                self._close_link(old)  # replaced (the agent restarted that worker): its sender ends too
            self._links[hello.local_rank] = link
            self._every.append(link)
        threading.Thread(target=self._sender, args=(link,), name="ftrt-send", daemon=True).start()
        link.outbox.put(self.spec.init)
        while True:
            try:
                message = conn.recv()
            except Exception:  # noqa: BLE001 - closed, or a message that cannot be read: the link is over
                break
            with self._cond:
                if isinstance(message, wire.Ready):
                    link.ready, link.place = True, message.place
                    call = self._current
                    if call is not None and call.seq not in self._cancelled:
                        self._send(link, call)  # its peers run the call in a round that includes it
                elif isinstance(message, wire.Reply):
                    link.replies[message.seq] = message
                    link.place = message.place
                self._cond.notify_all()
        self._close_link(link)

    def _sender(self, link: _Link) -> None:
        while (message := link.outbox.get()) is not None:
            try:
                link.conn.send(message)
            except Exception:  # noqa: BLE001 - the worker is gone (its exit is the agent's to handle)
                self._close_link(link)
                return

    def _close_link(self, link: _Link) -> None:
        with self._cond:
            if link.alive:
                link.alive = False
                link.outbox.put(None)
            self._cond.notify_all()

    def _send(self, link: _Link, call: wire.Call) -> None:
        """Queue ``call`` for ``link`` once (under the lock)."""
        if link.alive and call.seq not in link.sent:
            link.sent.add(call.seq)
            link.outbox.put(call)

    # -- the driver's side ----------------------------------------------------------------------
    def call(self, seq: int, method: str, payload: bytes) -> list[wire.Reply]:
        """Run the call on every worker of this node that is in the job; their replies (also of a
        worker that answered and then went). Held while none is (see the module docstring)."""
        call = wire.Call(seq, method, payload)
        with self._cond:
            if seq <= self._latest:
                return []  # given up by the driver before it arrived
            self._latest = seq
            self._current = call
            self._every = [lk for lk in self._every if lk.alive]
            for link in self._links.values():
                if link.ready:
                    self._send(link, call)
            try:
                while True:
                    got = [lk for lk in self._every if seq in lk.sent]
                    waiting = [lk for lk in got if lk.alive and seq not in lk.replies]
                    answered = [lk for lk in got if seq in lk.replies]
                    if answered and not waiting:
                        return [lk.replies.pop(seq) for lk in answered]
                    if not waiting and (seq in self._cancelled or seq < self._latest):
                        # the driver completed it without this node (cancel), or gave up on it (a
                        # newer call came): no worker here runs it any more
                        return [lk.replies.pop(seq) for lk in answered]
                    if self._agent_code is not None:
                        raise self._failed()
                    self._cond.wait(0.5)
            finally:
                if self._current is call:
                    self._current = None
                self._cancelled.discard(seq)

    def cancel(self, seq: int) -> None:
        """The call ``seq`` completed without this node's workers: stop holding it, unless one of
        them has it already."""
        with self._cond:
            self._cancelled.add(seq)
            self._latest = max(self._latest, seq)  # a call(seq) that arrives after this is not run
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        """The node, its agent, and each worker: pid, whether it is in the job, and its place."""
        with self._cond:
            return {"node_id": self.spec.node_id, "host_pid": os.getpid(),
                    "agent_pid": self._agent.pid if self._agent else None,
                    "agent_exit": self._agent_code, "log": self.log_path,
                    "workers": [{"local_rank": lk.local_rank, "pid": lk.pid, "ready": lk.ready,
                                 "place": lk.place} for lk in self._links.values() if lk.alive]}

    def stop(self, timeout: float = 30.0) -> int | None:
        """Tell the workers to finish, wait for the agent to end the job's part here, and clean up;
        the agent's exit code (None: it had to be killed)."""
        with self._cond:
            self._closing = True
            for link in self._links.values():
                if link.alive:
                    link.outbox.put(wire.Stop())
            deadline = time.monotonic() + timeout
            while self._agent_code is None and time.monotonic() < deadline:
                self._cond.wait(0.5)
            code = self._agent_code
        if code is None and self._agent is not None:
            self._agent.kill()
        self._server.close()
        tmpdirs.remove(self.dir)
        return code
