"""Changing rounds in place, the worker's side: process groups that survive a round change, and
the ranks' agreement on the state afterwards.

Under ``ftrt launch --recovery in-place`` (the default) a worker that builds its process group with
:meth:`ftrt.Runtime.init_process_group` keeps its process when the job's membership changes: the
agent hands it the new round over its control pipe (:mod:`ftrt.control`) instead of killing it.
A training loop then needs three things, which this module and :class:`ftrt.Runtime` give it:

1. **Notice the change.** A collective with a dead peer raises; a join or drain does not break
   anything. ``with rt.step():`` turns both into :class:`ftrt.WorldChanged`: at the start of a step
   when a new round is waiting, and when the step raised because a peer went (the worker waits up to
   ``--reconfigure-timeout`` for its agent's new round; no round: the error was the script's own and
   is raised unchanged).
2. **Take the new round.** :meth:`ftrt.Runtime.reconfigure` destroys the old process group and makes
   the new one (same backend, new rank and world size); rebuild what wraps the group (DDP).
3. **Agree on the state.** Ranks may be one optimizer step apart after a fault (a peer died after
   some ranks applied a step) and a newcomer has nothing: :func:`sync_state` agrees on the newest
   step and broadcasts the state from a rank that has it.

Every round's process group meets in a TCPStore under its own prefix (:func:`round_store`), so a
store that outlives a round (it lives in the first node's local rank 0 worker, which now also
outlives rounds) serves the next one without old keys in the way. Torch is imported on use only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from ftrt.errors import WorldChanged

if TYPE_CHECKING:
    import torch


class Waits(Protocol):
    """What :func:`allreduce_hook` needs of its state: :meth:`ftrt.Runtime.wait`."""

    def wait(self, work: Any) -> None: ...

WAIT_SLICE_S = 0.1
"""Slices of a bounded collective wait (:meth:`ftrt.Runtime.wait`): how soon a worker blocked on a
frozen peer notices its new round, at the cost of one timed-out wait per slice while it waits."""


def wait_leaving(work: Any, gone: "Callable[[], str | None]") -> None:
    """Wait for ``work`` in slices of :data:`WAIT_SLICE_S`; raise :class:`~ftrt.WorldChanged` when
    ``gone()`` says, between two slices, why the collective will not complete. A failed collective
    raises its own error."""
    slice_ = timedelta(seconds=WAIT_SLICE_S)
    while True:
        try:
            work.wait(timeout=slice_)
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise  # the collective failed (a dead peer): the step's error
        why = gone()
        if why is not None:
            raise WorldChanged(f"{why} while a collective waited.")


def leave_group() -> None:
    """Leave the default process group, also while a collective on it still waits for a frozen
    peer: ``abort()`` it (NCCL's ncclCommAbort), unregister it (``destroy_process_group``) and never
    free it.

    Freeing a gloo group joins its worker threads, and one blocked sending to a frozen peer waits
    out the group's timeout (30 min by default; seen here as a kept worker stuck in
    ``~ProcessGroupGloo``). So each group left this way is kept alive for the process's life, its
    thread ending on its own once the peer is gone or the timeout passes: a few sockets and a
    thread per fault. An extra reference (not a list, which the interpreter empties at exit and so
    frees the group then) keeps it from being freed even at the interpreter's exit."""
    import ctypes

    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    try:
        group.abort()
    except (AttributeError, RuntimeError):
        pass  # a backend without abort: unregistering is all there is
    dist.destroy_process_group()


def allreduce_hook(rt: Waits, bucket):  # unannotated: DDP refuses any annotation but its own classes
    """A DDP communication hook (``model.register_comm_hook(rt, allreduce_hook)``) that averages the
    gradients as DDP's default does, with the bounded wait of :meth:`ftrt.Runtime.wait`, so a
    backward pass on a frozen peer ends in :class:`~ftrt.WorldChanged` instead of blocking. The
    wait happens in the hook (DDP's reducer itself would wait on the future without a bound)."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    rt.wait(dist.all_reduce(buffer, async_op=True))
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


def round_prefix(round_no: int) -> str:
    """The key prefix of round ``round_no``'s default process group in the round's TCPStore."""
    return f"ftrt/round-{round_no}/"


def round_store(addr: str, port: int, round_no: int, timeout: float):
    """A client of the round's TCPStore (``MASTER_ADDR:MASTER_PORT``), under the round's prefix;
    ``timeout`` bounds each wait on it (meeting the other ranks)."""
    import torch.distributed as dist

    client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True)
    return dist.PrefixStore(round_prefix(round_no), client)


def sync_state(step: int, tensors: Iterable["torch.Tensor"], *, wait: "Callable[[Any], None] | None" = None) -> int:
    """Agree on the newest ``step`` over the default process group and give every rank the state of
    a rank that has it; returns that step.

    ``step``: the last optimizer step this rank applied (-1: none, e.g. a newcomer); ``tensors``:
    this rank's state, in the same order and shapes on every rank (parameters, optimizer buffers,
    a tensor holding RNG state...), overwritten in place on the ranks behind. The lowest rank that
    applied the newest step sends (nothing is sent when every rank has it). Call it on every rank
    after :meth:`ftrt.Runtime.reconfigure` and before wrapping the model again (DDP broadcasts rank
    0's parameters when built).

    ``wait``: how to wait for each collective, e.g. :meth:`ftrt.Runtime.wait` (bounded: a peer that
    froze or died during the agreement ends it in :class:`~ftrt.WorldChanged` once the next round
    comes, or in the collective's error; run it inside ``with rt.step():`` so that the error turns
    into the next round too). Default: a blocking wait.
    """
    import torch
    import torch.distributed as dist

    def done(work: Any) -> None:
        if wait is None:
            work.wait()
        else:
            wait(work)

    mine = torch.tensor([step], dtype=torch.int64)
    steps = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    done(dist.all_gather(steps, mine, async_op=True))
    applied = [int(t.item()) for t in steps]
    newest = max(applied)
    if min(applied) == newest:
        return newest  # every rank holds it already: nothing to send
    src = applied.index(newest)
    for t in tensors:
        done(dist.broadcast(t.data if t.requires_grad else t, src, async_op=True))
    return newest
