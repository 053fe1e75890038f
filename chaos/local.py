"""Local multi-node jobs on one machine: agents as subprocesses, faults on whole process trees.

Used by ``ftrt demo``, the benchmarks, the tests and the chaos suite. A :class:`LocalNode` is one
``ftrt launch`` agent plus the workers it starts; its faults act on the whole process tree (agent
and workers) like a machine dying (:meth:`LocalNode.kill`) or freezing (:meth:`LocalNode.freeze`).
Whether its spare workers are warm is the agent's own answer (:func:`spares_warm`: its ``Status``
RPC, at the address it registered in etcd).
:class:`StepLog` reads the JSON lines ``ftrt.examples.ddp_steps --all-ranks`` writes, so callers see
who stepped when at which world size. Waits poll with a deadline; nothing sleeps blindly.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from ftrt.procs import descendants  # noqa: F401 - re-exported for the tests' harness

if TYPE_CHECKING:
    from ftrt.agents.config import LaunchConfig
    from ftrt.auth import JobToken
    from ftrt.v1.agent_pb2 import StatusResponse


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll ``pred`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


async def until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """:func:`wait_until` for coroutines: poll ``pred`` without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class LocalNode:
    """One agent (``python -m ftrt.cli.main launch ...``) and its workers."""

    def __init__(self, workdir: Path, node_id: str, launch_args: list[str], *, env: dict | None = None,
                 command: list[str] | None = None):
        self.node_id = node_id
        self.log_path = Path(workdir) / f"agent-{node_id}.log"
        # ``command`` replaces the whole command line (e.g. torchrun for side-by-side benchmarks).
        self.args = command or [
            sys.executable, "-m", "ftrt.cli.main", "launch", "--node-id", node_id, *launch_args
        ]
        self.launch_args = list(launch_args)
        """The agent's ``ftrt launch`` options (the same when ``command`` wraps them)."""
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.agent = AgentLink(self)

    def start(self) -> "LocalNode":
        self._log = open(self.log_path, "ab")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)]

    def kill(self) -> float:
        """SIGKILL the agent and all its workers at once (a node dying); return the time."""
        pids = self.tree()
        t = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        return t

    def freeze(self, agent_only: bool = False) -> float:
        pids = [self.pid] if agent_only else self.tree()
        t = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self._frozen = pids
        return t

    def thaw(self) -> None:
        for pid in getattr(self, "_frozen", []):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def warm(self) -> bool:
        """The agent reported its spares warm (again) after starting them."""
        text = self.log()
        return "warm workers ready" in text

    def spares_warm(self, timeout: float = 1.0) -> bool:
        """The agent has at least ``--nproc-per-node`` warm spare workers (see :func:`spares_warm`)."""
        return spares_warm([self], timeout)

    def spares_warm_in_log(self) -> bool:
        """What the agent last logged about its spares: warm after its start, or warm again after
        its last round started. Only for an agent that cannot answer :meth:`spares_warm` because a
        fault holds it (frozen, or cut off from this machine): asking it would only time out, and
        what it logged before is what its spares were when it stopped answering."""
        text = self.log()
        started = text.rfind("started ranks")
        if started < 0:
            return "warm workers ready" in text
        return text.rfind("spares warm again") > started

    def agent_status(self, timeout: float = 1.0) -> StatusResponse | None:
        """The agent's answer to its ``Status`` RPC (None: not registered yet, or no answer in time)."""
        return asyncio.run(self.agent.status(timeout))

    def cleanup(self) -> None:
        if self.proc is None:
            return
        self.thaw()
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class AgentLink:
    """How to ask a node's agent over gRPC: the address it serves ``Status`` at, as it registered it
    in the job's etcd (the agent picks its port; a record of this node id another process left is
    not it), and the answers, with the agents' mutual TLS when the job uses it."""

    LOOKUP_EVERY_S = 1.0
    """How often :meth:`find` looks in etcd again while the agent has not registered."""

    def __init__(self, node: LocalNode) -> None:
        self.node = node
        self.addr: str | None = None
        """``host:port`` of the agent's gRPC service, once found (the agent keeps it for its life)."""
        self.token: "JobToken | None" = None
        """The job's token, read from etcd with the address (``Status`` answers only the job's own)."""
        self._config: LaunchConfig | None = None
        self._looked_up = -math.inf

    @property
    def config(self) -> LaunchConfig:
        """The agent's launch configuration, parsed from its options as ``ftrt launch`` parses them."""
        if self._config is None:
            from ftrt.agents.cli import parse_launch_args

            self._config = parse_launch_args(self.node.launch_args)
        return self._config

    @property
    def lookup_due(self) -> bool:
        """Not found yet, and not looked up in the last :attr:`LOOKUP_EVERY_S`."""
        return self.addr is None and time.monotonic() - self._looked_up >= self.LOOKUP_EVERY_S

    async def find(self, timeout: float, *, again: bool = True) -> str | None:
        """The agent's address, looked up in etcd until it is known (None: not registered yet, or
        etcd did not answer within ``timeout``). ``again=False``: not if the last look-up was less
        than :attr:`LOOKUP_EVERY_S` ago."""
        if self.addr is not None or not (again or self.lookup_due):
            return self.addr
        from ftrt.auth import read_token
        from ftrt.jobkeys import JobKeys
        from ftrt.records import NodeRecord, decode
        from ftrt.errors import ConfigError, StoreError
        from ftrt.store.etcd import EtcdStore

        cfg = self.config
        if cfg.standalone:
            raise ConfigError(f"Node {self.node.node_id} runs a standalone agent, which registers the address of its "
                              "Status service in an etcd of its own; give the agents a shared one (--etcd).")
        self._looked_up = time.monotonic()
        store = EtcdStore(cfg.etcd or "", timeout=timeout, access=cfg.etcd_access)
        keys = JobKeys(cfg.job_id)
        try:
            kv, _ = await store.get(keys.node(self.node.node_id))
            token = await read_token(store, keys, timeout=timeout) if kv is not None else None
        except StoreError:
            return None
        finally:
            await store.close()
        if kv is None or token is None or not self.node.alive():
            return None
        self.token = token
        rec = decode(NodeRecord, kv.value)
        if rec.pid in self.node.tree():
            self.addr = rec.agent_addr
        return self.addr

    async def status(self, timeout: float) -> StatusResponse | None:
        """The agent's answer to ``Status`` (None: not registered yet, or no answer within ``timeout``)."""
        import grpc

        from ftrt.agents.peers.service import status

        if await self.find(timeout) is None:
            return None
        try:
            return await status(self.addr, self.token, timeout=timeout, tls=self.config.agent_tls)  # type: ignore[arg-type]
        except grpc.aio.AioRpcError:  # frozen, cut off or gone: no answer
            return None

    async def spares_warm(self, timeout: float) -> bool:
        """The agent has at least ``--nproc-per-node`` warm spare workers, by its own answer."""
        st = await self.status(timeout)
        return st is not None and st.warm_workers >= self.config.nproc_per_node


def spares_warm(nodes: Iterable[LocalNode], timeout: float = 1.0) -> bool:
    """Whether every one of ``nodes``' agents has at least ``--nproc-per-node`` warm spare workers,
    by its own answer to ``Status`` (asked all at once, each within ``timeout``). An agent not
    registered yet, or that does not answer (frozen, cut off), is not warm."""
    links = [node.agent for node in nodes]

    async def ask() -> list[bool]:
        return await asyncio.gather(*(link.spares_warm(timeout) for link in links))

    return all(asyncio.run(ask())) if links else True


def find_agents(nodes: Iterable[LocalNode], timeout: float = 1.0) -> None:
    """Look up where the agents of ``nodes`` serve ``Status``, those not found yet and not looked
    up in the last :attr:`AgentLink.LOOKUP_EVERY_S`, so that a later :func:`spares_warm` is one
    quick RPC each (a caller that times faults calls this while it waits)."""
    links = [node.agent for node in nodes if node.agent.lookup_due]

    async def look() -> None:
        await asyncio.gather(*(link.find(timeout, again=False) for link in links))

    if links:
        asyncio.run(look())


def read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of a file another process appends to (a torn last line is skipped)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for raw in text.splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue  # a line being written
    return out


class StepLog:
    """The per-step JSON lines of ``ftrt.examples.ddp_steps``."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def lines(self) -> list[dict]:
        return read_jsonl(self.path)

    def after(self, t: float) -> list[dict]:
        return [x for x in self.lines() if x["time"] > t]

    def stepping(self, *, world: int, ranks: int, since: float = 0.0) -> dict[int, float] | None:
        """First time each of ``ranks`` ranks stepped at ``world`` after ``since``; None until all did."""
        first: dict[int, float] = {}
        for x in self.after(since):
            if x["world"] == world:
                first.setdefault(x["rank"], x["time"])
        return first if len(first) >= ranks else None


def worker_pids(etcd: str, job_id: str) -> dict[int, int]:
    """Global rank -> pid of every running worker of the job, as its agents report them."""
    import asyncio

    from ftrt.agents.ops.status import collect_status

    st = asyncio.run(collect_status(etcd, job_id, events=0))
    return {w["rank"]: w["pid"] for ws in st["workers"].values() for w in ws
            if w.get("state") == "running" and w.get("rank", -1) >= 0}
