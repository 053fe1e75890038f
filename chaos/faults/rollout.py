"""Rollout fleet faults: kill a rollout server (it may come back after a while), freeze one, add one.

Servers are ``ftrt rollout serve`` processes the runner started (``cluster.rollout_servers``),
named ``rollout0``, ``rollout1``, ...; :class:`RolloutServers` owns them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ftrt.chaos.faults import Context, Injected


class RolloutServers:
    """The run's rollout server processes, by name."""

    def __init__(self, work: Path, run: str, etcd: str, job_id: str, host: str, lease_ttl: float,
                 access_flags: list[str]) -> None:
        self.work, self.run, self.etcd, self.job_id = work, run, etcd, job_id
        self.host, self.lease_ttl, self.access_flags = host, lease_ttl, access_flags
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: set[int] = set()
        self.frozen: set[str] = set()

    def start(self, name: str) -> subprocess.Popen:
        log = open(self.work / f"{self.run}-{name}-{len(self.pids)}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftrt.cli.main", "rollout", "serve", "--etcd", self.etcd, *self.access_flags,
             "--job-id", self.job_id, "--server-id", name, "--host", self.host, "--lease-ttl", f"{self.lease_ttl:g}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        self.pids.add(proc.pid)
        return proc

    def alive(self) -> list[str]:
        return sorted(n for n, p in self.procs.items() if p.poll() is None)

    def next_name(self) -> str:
        return f"rollout{len(self.procs)}"

    def stop_all(self) -> None:
        """SIGTERM every server (each revokes its lease), SIGKILL what is left after 10 s."""
        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _pick(ctx: Context, target: str) -> str:
    fleet: RolloutServers = ctx.rollouts
    if target != "random":
        if target not in fleet.alive():
            raise RuntimeError(f"rollout server {target} is not running")
        return target
    free = [n for n in fleet.alive() if n not in fleet.frozen and n not in ctx.busy]
    if not free:
        raise RuntimeError("no rollout server is running (and free of other faults) to inject a fault into")
    return ctx.rng.choice(free)


def kill_rollout(ctx: Context, fault) -> Injected:
    """SIGKILL a rollout server; with ``duration_s`` it starts again (same name) after that long."""
    name = _pick(ctx, fault.target)
    proc = ctx.rollouts.procs[name]
    proc.kill()
    proc.wait()
    if fault.duration_s is None:
        return Injected(name, detail=f"SIGKILL rollout server (pid {proc.pid})")
    return Injected(name, end=lambda: ctx.rollouts.start(name),
                    detail=f"SIGKILL rollout server (pid {proc.pid}); restarted after {fault.duration_s} s")


def _sampling_now(ctx: Context, name: str, within: float = 5.0) -> bool:
    """Wait (up to ``within`` s) for server ``name`` to be sampling a group, so that a freeze holds
    work in flight (the deadline path) rather than catching it idle; whether it was."""
    import asyncio
    import time

    import grpc

    from ftrt.jobkeys import JobKeys
    from ftrt.rollout.records import ServerRecord
    from ftrt.store.access import EtcdAccess
    from ftrt.store.etcd import EtcdStore
    from ftrt.v1 import rollout_pb2, rollout_pb2_grpc

    async def addr() -> str | None:
        store = EtcdStore(ctx.etcd_endpoints, timeout=3.0, access=ctx.etcd_access or EtcdAccess())
        try:
            kv, _ = await store.get(JobKeys(ctx.job_id).rollout_server(name))
            return ServerRecord.decode(kv.value).addr if kv else None
        finally:
            await store.close()

    where = asyncio.run(addr())
    if where is None:
        return False
    end = time.monotonic() + within
    with grpc.insecure_channel(where) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        while time.monotonic() < end:
            try:
                if stub.Info(rollout_pb2.InfoRequest(), timeout=1.0).generating_s > 0:
                    return True
            except grpc.RpcError:
                return False
            time.sleep(0.002)
    return False


def freeze_rollout(ctx: Context, fault) -> Injected:
    name = _pick(ctx, fault.target)
    pid = ctx.rollouts.procs[name].pid
    busy = _sampling_now(ctx, name)
    os.kill(pid, signal.SIGSTOP)
    ctx.rollouts.frozen.add(name)

    def thaw() -> None:
        ctx.rollouts.frozen.discard(name)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    return Injected(name, end=thaw, detail=f"SIGSTOP rollout server (pid {pid}) for {fault.duration_s} s, "
                                           + ("while it sampled a group" if busy else "while idle"))


def add_rollout(ctx: Context, fault) -> Injected:
    name = ctx.rollouts.next_name()
    proc = ctx.rollouts.start(name)
    return Injected(name, detail=f"started rollout server (pid {proc.pid})")
