"""The ranks' agreement to end a round at a step boundary, for any training loop.

When a node joins or drains, ftrt asks the workers to end their round at a step boundary
(:meth:`ftrt.Runtime.round_ending`, docs/design.md "Ending a round at a step boundary"). Each rank
sees the request at its own moment, so the ranks agree on the step with one all-reduce of a flag;
:class:`RoundEndVote` runs it one step behind, so that no step waits on it. Torch-free at import.
"""

from __future__ import annotations

from ftrt.runtime import Runtime


def distributed():
    """``torch.distributed`` when a default process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class RoundEndVote:
    """The ranks' agreement to end the round at a step boundary, because ftrt asked (a node joins or
    drains): :meth:`ftrt.Runtime.round_ending` seen on any rank, max-reduced over the default group
    (each rank sees the request at its own moment).

    Call it once per optimizer step on every rank, at the same steps. It runs one step behind, so
    that no step waits on it: each call starts this step's all-reduce of a one-element flag without
    waiting (``async_op``) and returns the agreement of the call before, done by then (on GPUs it
    adds no host synchronisation with the step just queued). A request seen during step N ends the
    round after step N+1, on every rank; the agent allows a few steps for that. Always False
    outside ``ftrt launch``. :meth:`close` waits for the all-reduce in flight (call it before the
    process group goes; :meth:`ftrt.Runtime.exit_for_round` needs nothing)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._pending: tuple[object, object] | None = None  # (work, flag) of the call before

    def __call__(self) -> bool:
        if not self.rt.launched_by_ftrt:
            return False
        mine = self.rt.round_ending()
        dist = distributed()
        if dist is None:
            return mine
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1.0 if mine else 0.0], device=device)
        before, self._pending = self._pending, (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return before is not None and self._agreed(before)

    def _agreed(self, pending: tuple[object, object]) -> bool:
        work, flag = pending
        self.rt.wait(work)  # in place, a frozen peer ends it with ftrt.WorldChanged
        return flag.item() > 0

    def close(self) -> None:
        """Wait for the all-reduce in flight, if any (the last call's)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._agreed(pending)
