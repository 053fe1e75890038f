"""Test helpers for the rollout fleet: real `ftrt rollout serve` processes and trainer runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftrt import envnames
from ftrt.chaos.local import wait_until

EXACT = ("step", "reward_mean", "loss", "kl", "world_size", "prompt_ids", "weight_version")


def lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def exact(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in EXACT} for r in rows]


class Server:
    """One `ftrt rollout serve` process, its log in ``tmp``, its diagnostic trace (the groups it
    takes and answers) beside it."""

    def __init__(self, tmp: Path, etcd: str, job_id: str, server_id: str, *extra: str) -> None:
        self.server_id = server_id
        self.log_path = tmp / f"{server_id}.log"
        self.trace_path = tmp / f"{server_id}.trace"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftrt.cli.main", "rollout", "serve", "--etcd", etcd, "--job-id", job_id,
             "--server-id", server_id, *extra],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, envnames.DIAG_TRACE: str(self.trace_path)})

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def held(self) -> set[tuple[int, int]]:
        """The (step, prompt) groups this server has taken and not answered: its trace marks a group
        when it takes it and again before any answer leaves (:mod:`ftrt._diag`)."""
        try:
            text = self.trace_path.read_text()
        except FileNotFoundError:
            return set()
        held: set[tuple[int, int]] = set()
        for mark in map(json.loads, text.splitlines(keepends=True)[:None if text.endswith("\n") else -1]):
            group = (mark.get("step"), mark.get("prompt_id"))
            if mark["event"] == "rollout.generate":
                held.add(group)
            elif mark["event"] == "rollout.answer":
                held.discard(group)
        return held

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fleet_config(tmp: Path, name: str, etcd: str, job_id: str, *extra: str) -> list[str]:
    return [f"metrics_path={tmp / name}.jsonl", "rollout.mode=fleet", f"rollout.etcd={etcd}",
            f"rollout.job_id={job_id}", "progress=none", *extra]


def trainer(tmp: Path, config: list[str]) -> subprocess.Popen:
    """A one-process GRPO trainer (not under ftrt launch), output in ``tmp/trainer.log``."""
    return subprocess.Popen([sys.executable, "-m", "ftrt.grpo", *config], stdout=open(tmp / "trainer.log", "a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_steps(path: Path, n: int, timeout: float = 120) -> None:
    wait_until(lambda: len(lines(path)) >= n, timeout, f"{n} steps in {path.name}", interval=0.02)


def wait_registered(servers: list[Server], timeout: float = 90) -> None:
    """Every server has printed that it serves (it has the spec and a port)."""
    wait_until(lambda: all("registered as" in s.log() for s in servers), timeout, "servers registered")


def freeze_holding_groups(server: Server, tries: int = 200) -> None:
    """SIGSTOP ``server`` at a moment it surely holds a prompt group: it is frozen just after its
    trace shows one taken, and kept frozen only if the trace, read after the freeze, still shows a
    group without its answer (a frozen server writes no more marks). Otherwise it is let go and
    the next group it takes is waited for."""
    for _ in range(tries):
        wait_until(lambda: bool(server.held()), 120, f"{server.server_id} to take a group", interval=0.01)
        server.signal(signal.SIGSTOP)
        if server.held():
            return
        server.signal(signal.SIGCONT)
    raise AssertionError(f"{server.server_id} answered every group before it was frozen, {tries} times")


def stop_all(procs) -> None:
    for p in procs:
        if isinstance(p, Server):
            p.stop()
        elif p.poll() is None:
            p.kill()
            p.wait()
    time.sleep(0)
