"""Test harness: the local-cluster helpers of :mod:`ftrt.chaos.local`, plus the tests' defaults."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ftrt.chaos.local import LocalNode as Node  # noqa: F401
from ftrt.chaos.local import StepLog as Progress  # noqa: F401
from ftrt.chaos.local import descendants, wait_until  # noqa: F401

FAST_WARM = ("--warm-import", "torch", "--warm-import", "torch.distributed")


def ddp_args(progress: Path, *, steps: int, step_time: float = 0.05, extra: tuple[str, ...] = ()) -> list[str]:
    """Script arguments for the example workload in its fast (no DDP) mode, restarting its workers at
    every round change (``--no-in-place``; ``extra`` may say ``--in-place``: the last one counts)."""
    return [
        "-m", "ftrt.examples.ddp_steps", "--plain", "--no-in-place", "--steps", str(steps), "--step-time", str(step_time),
        "--progress", str(progress), "--all-ranks", "--ckpt", str(progress) + ".ckpt", *extra,
    ]


def lose_node_b(tmp: Path, args: list[str], etcd: str, job_id: str, ready: Callable[[], bool], what: str,
                timeout: float = 180, env_b: dict[str, str] | None = None) -> tuple[dict[str, Node], set[int]]:
    """Nodes ``a`` and ``b`` run the job ``args`` (``b`` with ``env_b`` too); once ``ready()``
    (``what``, for the error), ``b`` is SIGKILLed and ``a`` runs to the job's end (exit 0). Returns
    both nodes and the pids of the job's workers just before the kill."""
    from ftrt.chaos.local import worker_pids

    nodes = {n: Node(tmp, n, args, env=env_b if n == "b" else None).start() for n in ("a", "b")}
    try:
        wait_until(ready, 120, what)
        before = set(worker_pids(etcd, job_id).values())
        nodes["b"].kill()
        assert nodes["a"].wait(timeout) == 0, nodes["a"].log()[-3000:]
    finally:
        for n in nodes.values():
            n.cleanup()
    return nodes, before


def replica_steps(holder: Node, source: str) -> list[int]:
    """The steps of the newest replicas ``holder``'s agent holds from node ``source``, one per rank."""
    steps = []
    pattern = f"ftrt-mem-{holder.pid}-*/replicas/{source}/rank-*/current.json"
    for index in [*Path("/dev/shm").glob(pattern), *Path(os.environ.get("TMPDIR", "/tmp")).glob(pattern)]:
        try:
            steps.append(json.loads(index.read_text())["step"])
        except (OSError, ValueError, KeyError):
            return []  # being replaced just now
    return steps


def kill_at_rest(node: Node, survivor: Node, hold: Path, last_step: Callable[[], int]) -> float:
    """Kill ``node`` while a ``tier_worker.py`` job holds still between two steps (``hold`` is the file
    given as its HOLD argument) and ``survivor`` holds replicas of ``node``'s ranks at the last step;
    return the kill time. The job goes on when the kill is done.

    Replication is asynchronous, and a memory restore needs a step that the survivor holds both of
    its own ranks (its current and previous copy; a save in progress replaces the previous one) and
    of the lost node's (the replica). A kill at a random moment can miss that window under load, and
    the restore then rightly comes from storage; tests of the memory tier kill at rest instead.
    """
    hold.touch()
    try:
        seen: list[int] = []

        def at_rest() -> bool:
            seen.append(last_step())
            held = replica_steps(survivor, node.node_id)
            return len(seen) > 20 and seen[-1] == seen[-20] and bool(held) and min(held) >= seen[-1]

        wait_until(at_rest, 60, f"the job at rest with current replicas of {node.node_id}", interval=0.02)
        return node.kill()
    finally:
        hold.unlink()
