"""The memory restore: load a state from the memory checkpoints the job's nodes hold.

Collective, on the checkpointer's group; every rank gets the same answer:

1. each rank scans its node's memory directory (own arenas and peers' replicas; an index enters
   only through :func:`~ftrt.checkpoint.memindex.check_index`) and the ranks all-gather what
   their nodes hold;
2. :func:`~ftrt.checkpoint.memtier.choose` picks the newest ``(step, round)`` whose held old ranks
   cover every tensor; it is used only if it is not older than storage's newest checkpoint;
3. each rank works out which old ranks' arenas overlap its part of the state, the holders
   broadcast the arenas some rank needs but its node lacks, and every rank copies the
   overlapping boxes of the old shards into its own (:func:`~ftrt.checkpoint.memtier.fill`).

A layout the memory tier cannot reshard on any rank makes every rank fall back to storage (None).
"""

from __future__ import annotations

import logging
from typing import Any

from ftrt import _diag
from ftrt.checkpoint import memtier
from ftrt.checkpoint import state as st
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.memindex import MemIndex
from ftrt.checkpoint.memtier import HeldIndex

log = logging.getLogger(__name__)


class MemoryRestore:
    """Restores one checkpointer's state from its nodes' memory tier (see the module docstring).

    Args:
        group: the checkpointer's ranks.
        mem_dir: this node's memory-tier directory.
    """

    def __init__(self, group: CheckpointGroup, mem_dir: str) -> None:
        self._group = group
        self._mem_dir = mem_dir

    def restore(self, state: dict[str, Any], newest_storage: int) -> int | None:
        """Restore from the newest complete memory checkpoint held by this job's nodes, if it is at
        least as new as ``newest_storage`` (storage's newest step, -1 for none); return its step,
        or None (nothing usable: restore from storage). Collective."""
        import torch

        g = self._group
        mine = memtier.scan(self._mem_dir)
        held: list[list[MemIndex]] = g.all_gather([_without_file(m) for m in mine])
        pick = memtier.choose(held)
        if pick is None or pick.step < newest_storage:
            (log.warning if any(held) else log.debug)(
                "memory tier not used: %s (storage's newest: step %s; the nodes hold %s)",
                "no step is held whole" if pick is None else f"its newest whole step {pick.step} is older",
                newest_storage if newest_storage >= 0 else "none", memtier.describe(held))
            return None
        step, rnd, world, holders = pick
        _diag.mark("restore.memory.chosen")
        indexes: list[dict[int, HeldIndex]] = g.all_gather(
            {m["rank"]: m for m in mine if (m["step"], m["round"], m["world"]) == (step, rnd, world)})
        old: dict[int, MemIndex] = {r: indexes[h][r] for r, h in holders.items()}
        target = st.to_dcp(state)
        t_flat, _ = memtier.flatten(target)
        local = indexes[g.rank]
        arenas = {r: torch.from_file(m["file"], shared=False, size=m["size"], dtype=torch.uint8) for r, m in local.items()}
        try:
            need = memtier.needed_ranks(t_flat, old, set(local))
            error = None
        except memtier.Unsupported as exc:
            need, error = set(), str(exc)
        _diag.mark("restore.memory.indexed")
        needs: list[tuple[list[int], str | None]] = g.all_gather((sorted(need), error))
        _diag.mark("restore.memory.planned")
        errors = [e for _, e in needs if e]
        if errors:
            log.warning("memory tier cannot restore this state (%s); using storage", errors[0])
            return None
        for r in sorted(holders):
            holder = holders[r]
            if not any(r in n and i != holder for i, (n, _) in enumerate(needs)):
                continue
            buf = arenas[r] if g.rank == holder else torch.empty(old[r]["size"], dtype=torch.uint8)
            g.broadcast_tensor(buf, holder)
            if r in needs[g.rank][0]:
                arenas[r] = buf
        _diag.mark("restore.memory.fetched")
        try:
            memtier.fill(t_flat, old, arenas, files={r: m["file"] for r, m in local.items()})
            error = None
        except memtier.Unsupported as exc:
            error = str(exc)
        errors = [e for e in g.all_gather(error) if e]
        if errors:
            log.warning("memory tier could not restore (%s); using storage", errors[0])
            return None
        _diag.mark("restore.memory.filled")
        loaded = memtier.unflatten(old[min(old)]["skeleton"], t_flat)
        st.apply(state, loaded)
        log.info("restored checkpoint step %d from memory (saved by %d ranks in round %d)", step, world, rnd)
        return step


def _without_file(held: HeldIndex) -> MemIndex:
    """The index alone: what the other ranks need to know of a checkpoint this node holds (its file
    is a path on this node)."""
    return {k: v for k, v in held.items() if k != "file"}  # type: ignore[return-value]


__all__ = ["MemoryRestore"]
