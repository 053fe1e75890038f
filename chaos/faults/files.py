"""Checkpoint file faults: flip a byte in, or truncate, the newest committed checkpoint's data.

The damaged step is recorded so the end-of-run check expects it to fail verification (and
every other committed checkpoint to pass).
"""

from __future__ import annotations

import os
from pathlib import Path

from ftrt.chaos.faults import Context, Injected


def _newest_data_file(ctx: Context) -> tuple[int, Path]:
    from ftrt.checkpoint.storage import MANIFEST

    steps = sorted(ctx.ckpt_dir.glob("step-*"), reverse=True)
    for folder in steps:
        if (folder / MANIFEST).exists():
            data = [p for p in folder.iterdir() if p.name.startswith("__") and p.stat().st_size > 0]
            if data:
                return int(folder.name.split("-")[1]), max(data, key=lambda p: p.stat().st_size)
    raise RuntimeError(f"no committed checkpoint under {ctx.ckpt_dir} to damage")


def corrupt(ctx: Context, fault) -> Injected:
    step, path = _newest_data_file(ctx)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    ctx.corrupted_steps.add(step)
    return Injected(f"step {step}", detail=f"flipped a byte of {path.name}")


def truncate(ctx: Context, fault) -> Injected:
    step, path = _newest_data_file(ctx)
    os.truncate(path, os.path.getsize(path) // 2)
    ctx.corrupted_steps.add(step)
    return Injected(f"step {step}", detail=f"truncated {path.name} to half")
