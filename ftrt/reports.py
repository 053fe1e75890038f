"""The worker -> agent report messages: the one owner of their types and fields.

A worker writes JSON lines to the pipe named by ``FTRT_REPORT_FD`` (:meth:`ftrt.Runtime.report`);
its agent reads them (:mod:`ftrt.agents.workers`). Each message is an object whose ``"t"`` is one of
the types below. A message is never acknowledged, and one the agent is too far behind to read is
dropped, so none may be needed for correctness: they drive supervision (heartbeats), replication
(``mem``), the metrics and the event log. The agent ignores types it does not know and messages whose
fields have the wrong type.
"""

from __future__ import annotations

import time
from typing import Any

READY = "ready"
"""``{"t", "pid", "store_port"}``: a warm worker (or the spare template) is ready for an assignment."""
EXIT = "exit"
"""``{"t", "pid", "code"}``: from the spare template only, a spare it forked has exited (the agent is
not that process's parent, so it cannot wait for it)."""
HEARTBEAT = "hb"
"""``{"t", "step", "time"}``: the worker reached ``step`` (:meth:`ftrt.Runtime.heartbeat`). After the
first, a worker silent for the agent's ``--hang-timeout`` is hung."""
DONE = "done"
"""``{"t", "step"}``: the worker finished its work (:meth:`ftrt.Runtime.done`); what follows is its
teardown, which hang detection does not judge."""
BOUNDARY = "boundary"
"""``{"t"}``: the worker polls the round-end file (:mod:`ftrt.agents.boundary`)."""
MEM = "mem"
"""``{"t", "rank", "step", "bytes", "save_s"}``: a memory checkpoint of ``rank`` at ``step`` is complete
in the node's memory directory; the agent replicates it to its peer and counts it in the metrics."""
CKPT = "ckpt"
"""``{"t", "tier", "rank", "step", "bytes", "save_s"}``: a checkpoint was committed to ``tier``."""
RESTORE = "restore"
"""``{"t", "rank", "tier", "step", "seconds"}``: the worker restored ``step`` from ``tier``."""
STATS = "stats"
"""``{"t", "values": {name: number}}``: trainer metrics for Prometheus (:meth:`ftrt.Runtime.report_metrics`)."""

CHECKPOINT_TYPES = (MEM, CKPT, RESTORE)
"""The checkpointer's reports (its ``report=`` callback receives these)."""


def heartbeat(step: int) -> dict[str, Any]:
    return {"t": HEARTBEAT, "step": int(step), "time": time.time()}


def done(step: int) -> dict[str, Any]:
    return {"t": DONE, "step": int(step)}


def ready(pid: int, store_port: int) -> dict[str, Any]:
    return {"t": READY, "pid": pid, "store_port": store_port}


def spare_exit(pid: int, code: int) -> dict[str, Any]:
    return {"t": EXIT, "pid": pid, "code": code}


def boundary() -> dict[str, Any]:
    return {"t": BOUNDARY}


def memory_saved(rank: int, step: int, nbytes: int, save_s: float) -> dict[str, Any]:
    return {"t": MEM, "rank": rank, "step": step, "bytes": nbytes, "save_s": round(save_s, 6)}


def committed(tier: str, rank: int, step: int, nbytes: int, save_s: float) -> dict[str, Any]:
    return {"t": CKPT, "tier": tier, "rank": rank, "step": step, "bytes": nbytes, "save_s": round(save_s, 6)}


def restored(rank: int, tier: str | None, step: int, seconds: float) -> dict[str, Any]:
    return {"t": RESTORE, "rank": rank, "tier": tier, "step": step, "seconds": round(seconds, 6)}


def stats(values: dict[str, float]) -> dict[str, Any]:
    return {"t": STATS, "values": {k: float(v) for k, v in values.items()}}
