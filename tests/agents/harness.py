"""Test harness: the local-cluster helpers of :mod:`ftrt.chaos.local`, plus the tests' defaults."""

from __future__ import annotations

from pathlib import Path

from ftrt.chaos.local import LocalNode as Node  # noqa: F401
from ftrt.chaos.local import StepLog as Progress  # noqa: F401
from ftrt.chaos.local import descendants, wait_until  # noqa: F401

FAST_WARM = ("--warm-import", "torch", "--warm-import", "torch.distributed")


def ddp_args(progress: Path, *, steps: int, step_time: float = 0.05, extra: tuple[str, ...] = ()) -> list[str]:
    """Script arguments for the example workload in its fast (no DDP) mode."""
    return [
        "-m", "ftrt.examples.ddp_steps", "--plain", "--steps", str(steps), "--step-time", str(step_time),
        "--progress", str(progress), "--all-ranks", "--ckpt", str(progress) + ".ckpt", *extra,
    ]
