"""Process faults: kill or freeze one worker, or a whole node (its agent and workers)."""

from __future__ import annotations

import asyncio
import os
import signal

from ftrt.chaos.faults import Context, Injected


def _worker_of(ctx: Context, node_id: str) -> tuple[int, int]:
    """(rank, pid) of a running worker on ``node_id``, as its agent reports it."""
    from ftrt.agents.status import collect_status

    st = asyncio.run(collect_status(ctx.etcd_endpoints, ctx.job_id, events=0))
    workers = [w for w in st["workers"].get(node_id, []) if w.get("state") == "running" and w.get("pid")]
    if not workers:
        raise RuntimeError(f"{node_id} reports no running worker")
    w = ctx.rng.choice(sorted(workers, key=lambda w: w["rank"]))
    return w["rank"], w["pid"]


def kill_worker(ctx: Context, fault) -> Injected:
    node = ctx.pick_node(fault.target)
    rank, pid = _worker_of(ctx, node)
    os.kill(pid, signal.SIGKILL)
    return Injected(node, detail=f"SIGKILL rank {rank} (pid {pid})")


def kill_node(ctx: Context, fault) -> Injected:
    node = ctx.pick_node(fault.target)
    ctx.nodes[node].kill()
    ctx.killed.add(node)
    return Injected(node, detail="SIGKILL agent and workers")


def freeze_worker(ctx: Context, fault) -> Injected:
    node = ctx.pick_node(fault.target)
    rank, pid = _worker_of(ctx, node)
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
