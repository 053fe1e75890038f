"""Local multi-node jobs on one machine: agents as subprocesses, faults on whole process trees.

Used by ``ftrt demo``, the benchmarks, the tests and the chaos suite. A :class:`LocalNode` is one
``ftrt launch`` agent plus the workers it starts; its faults act on the whole process tree (agent
and workers) like a machine dying (:meth:`LocalNode.kill`) or freezing (:meth:`LocalNode.freeze`).
:class:`StepLog` reads the JSON lines ``ftrt.examples.ddp_steps --all-ranks`` writes, so callers see
who stepped when at which world size. Waits poll with a deadline; nothing sleeps blindly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll ``pred`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
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
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

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

    def spares_warm(self) -> bool:
        """The agent's spare workers are warm: after its start, or again after its last round started."""
        text = self.log()
        started = text.rfind("started ranks")
        if started < 0:
            return "warm workers ready" in text
        return text.rfind("spares warm again") > started

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

    from ftrt.agents.status import collect_status

    st = asyncio.run(collect_status(etcd, job_id, events=0))
    return {w["rank"]: w["pid"] for ws in st["workers"].values() for w in ws
            if w.get("state") == "running" and w.get("rank", -1) >= 0}
