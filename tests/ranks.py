"""Two (or more) real gloo ranks for a test: spawned processes that each run ``target(rank, init,
*args, out)`` and put one ``(rank, result)`` on ``out`` (see :func:`say`)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any, Callable


def say(out: Any, rank: int, result: Any) -> None:
    """Put this rank's result and wait until it is sent: a rank that exits with ``os._exit`` or
    freezes right after would otherwise lose it (the queue sends from a thread of its own)."""
    out.put((rank, result))
    out.close()
    out.join_thread()


def run_ranks(target: Callable[..., None], tmp_path: Path, *args: Any, world: int = 2, timeout: float = 120,
              kill: tuple[int, ...] = ()) -> dict[int, Any]:
    """Run ``world`` ranks meeting in a file store under ``tmp_path``; return each rank's result.
    The ranks in ``kill`` are killed once every rank has said its result (a frozen peer); the others
    must exit 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=target, args=(r, init, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        said = dict(out.get(timeout=timeout) for _ in procs)
    finally:
        for r in kill:
            procs[r].kill()
        for p in procs:
            p.join(30)
    for r, p in enumerate(procs):
        if r not in kill:
            assert p.exitcode == 0, f"rank {r} exited with {p.exitcode}"
    return said
