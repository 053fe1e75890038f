"""Process faults: kill or freeze one worker, or a whole node (its agent and workers; a killed node
may restart); and planned departures: drain a node (SIGTERM to its agent) or preempt it (a notice
through its ``--preemption-file``, a SIGKILL after the notice's lead)."""

from __future__ import annotations

import asyncio
import os
import signal

from ftrt.chaos.faults import Context, Injected


def _worker_of(ctx: Context, target: str) -> tuple[str, int, int]:
    """(node, rank, pid) of a running worker on ``target`` (``random``: on a node that has one)."""
    from ftrt.agents.ops.status import collect_status

    st = asyncio.run(collect_status(ctx.etcd_endpoints, ctx.job_id, events=0, **ctx.status_access()))
    running = {n: [w for w in ws if w.get("state") == "running" and w.get("pid") and w.get("rank", -1) >= 0]
               for n, ws in st["workers"].items()}
    node = ctx.pick_node(target, among=[n for n, ws in running.items() if ws])
    if not running.get(node):
        raise RuntimeError(f"{node} reports no running worker")
    w = ctx.rng.choice(sorted(running[node], key=lambda w: w["rank"]))
    return node, w["rank"], w["pid"]


def kill_worker(ctx: Context, fault) -> Injected:
    node, rank, pid = _worker_of(ctx, fault.target)
    os.kill(pid, signal.SIGKILL)
    return Injected(node, detail=f"SIGKILL rank {rank} (pid {pid})")


def kill_node(ctx: Context, fault) -> Injected:
    """SIGKILL a node; with ``duration_s`` it starts again (same id, a new agent) after that long."""
    node = ctx.pick_node(fault.target)
    ctx.nodes[node].kill()
    ctx.killed.add(node)
    if fault.duration_s is None:
        return Injected(node, detail="SIGKILL agent and workers")

    def restart() -> None:
        ctx.nodes[node] = ctx.start_node(node)
        ctx.killed.discard(node)

    return Injected(node, end=restart, detail=f"SIGKILL agent and workers; restarted after {fault.duration_s} s")


def drain_node(ctx: Context, fault) -> Injected:
    """SIGTERM a node's agent: it drains and exits 0; with ``duration_s`` it starts again after that long."""
    node = ctx.pick_node(fault.target)
    ctx.nodes[node].proc.send_signal(signal.SIGTERM)
    if fault.duration_s is None:
        return Injected(node, detail="SIGTERM to the agent (drain)")

    def restart() -> None:
        if ctx.nodes[node].alive():  # still draining after duration_s: what is left goes, as a crash
            ctx.nodes[node].kill()
        ctx.nodes[node] = ctx.start_node(node)

    return Injected(node, end=restart, detail=f"SIGTERM to the agent (drain); restarted after {fault.duration_s} s")


def preempt_node(ctx: Context, fault) -> Injected:
    """A preemption notice (the node's ``--preemption-file`` appears), a SIGKILL of whatever is left
    ``duration_s`` later, then the node starts again (a replacement machine)."""
    node = ctx.pick_node(fault.target)
    notice = ctx.preemption_file(node)
    notice.touch()

    def kill_and_replace() -> None:
        drained = not ctx.nodes[node].alive()
        if not drained:
            ctx.nodes[node].kill()
        notice.unlink(missing_ok=True)
        ctx.nodes[node] = ctx.start_node(node)

    return Injected(node, end=kill_and_replace,
                    detail=f"preemption notice; SIGKILL {fault.duration_s} s later, then a replacement")


def freeze_worker(ctx: Context, fault) -> Injected:
    node, rank, pid = _worker_of(ctx, fault.target)
    os.kill(pid, signal.SIGSTOP)

    def thaw() -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the agent killed it as hung: that is the point

    return Injected(node, end=thaw, detail=f"SIGSTOP rank {rank} (pid {pid}) for {fault.duration_s} s")


def freeze_node(ctx: Context, fault) -> Injected:
    node = ctx.pick_node(fault.target)
    ctx.nodes[node].freeze()
    return Injected(node, end=ctx.nodes[node].thaw, detail=f"SIGSTOP agent and workers for {fault.duration_s} s")
