"""The ranks of one checkpointer and the collectives its parts run among them.

A checkpointer's collectives run on gloo groups of its own, created when it is built: the persist
thread's (DCP's save, the checksums, the commit, the restores) run on one, so they never
interleave with the training loop's; the training thread's one collective (``skip_if_busy``'s
vote) runs on a second, so it never interleaves with the persist thread's. Without an initialised
torch.distributed every collective is this process alone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from ftrt import _diag


class CheckpointGroup:
    """This process's rank among a checkpointer's ranks and the collectives between them.

    Args:
        process_group: ranks taking part (default: the whole world if torch.distributed is
            initialised, else this process alone). Must be created on every rank alike.
        wait: how the training thread's vote waits for its collective (default: blocking);
            :meth:`ftrt.Runtime.wait` in place, so a frozen peer ends it in
            :class:`ftrt.WorldChanged` once the next round comes.
    """

    def __init__(self, process_group: Any = None, wait: Callable[[Any], None] | None = None) -> None:
        self._wait = wait or (lambda work: work.wait())
        self.distributed: bool = dist.is_available() and dist.is_initialized()
        """Whether there are other ranks (torch.distributed is initialised)."""
        if self.distributed:
            self.rank: int = dist.get_rank()
            self.world: int = dist.get_world_size(process_group) if process_group else dist.get_world_size()
            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            self.pg: Any = dist.new_group(ranks=ranks, backend="gloo")
            """The group of the persist thread's collectives (DCP's too); None alone."""
            self._vote_pg: Any = dist.new_group(ranks=ranks, backend="gloo")
        else:
            self.rank, self.world, self.pg, self._vote_pg = 0, 1, None, None

    def any_rank(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true on every rank when it is true on any (one collective on the vote group,
        for the training thread; this rank's own view with ``FTRT_DIAG_OFF=vote``)."""
        if not self.distributed or _diag.off("vote"):
            return tuple(flags)
        import torch

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._vote_pg, async_op=True))
        return tuple(bool(v) for v in t.tolist())

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The group's rank 0's ``obj``, on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return box[0]

    def broadcast_tensor(self, buf: Any, src: int) -> None:
        """Fill ``buf`` on every rank with the group's rank ``src``'s ``buf``."""
        dist.broadcast(buf, src=dist.get_global_rank(self.pg, src), group=self.pg)


__all__ = ["CheckpointGroup"]
