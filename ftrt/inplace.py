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
   step and broadcasts the state from a rank that has it (tensors in the same order on every
   rank); :func:`sync_state_dict` does it for a checkpointer's state dict (a newcomer's optimizer
   state and a trainer's counters included).

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


def _waiter(wait: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """How the agreement waits for a collective: ``wait(work)``, or a blocking ``work.wait()``."""
    return wait if wait is not None else (lambda work: work.wait())


def _applied_steps(step: int, done: Callable[[Any], None]) -> list[int]:
    """Every rank's last applied step, in rank order (one all-gather on the default group)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([step], dtype=torch.int64)
    steps = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    done(dist.all_gather(steps, mine, async_op=True))
    return [int(t.item()) for t in steps]


def sync_state(step: int, tensors: Iterable["torch.Tensor"], *, wait: Callable[[Any], None] | None = None) -> int:
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
    import torch.distributed as dist

    done = _waiter(wait)
    applied = _applied_steps(step, done)
    newest = max(applied)
    if min(applied) == newest:
        return newest  # every rank holds it already: nothing to send
    src = applied.index(newest)
    for t in tensors:
        done(dist.broadcast(t.data if t.requires_grad else t, src, async_op=True))
    return newest


def _source(applied: list[int], prefer: int | None) -> int:
    """The rank whose state every rank takes: ``prefer`` when it holds one (applied a step), else the
    lowest rank that applied the newest step."""
    if prefer is not None and 0 <= prefer < len(applied) and applied[prefer] >= 0:
        return prefer
    return applied.index(max(applied))


def sync_state_dict(step: int, state: dict[str, Any], *, wait: Callable[[Any], None] | None = None,
                    prefer: int | None = None) -> int:
    """:func:`sync_state` for a whole state as a :class:`~ftrt.checkpoint.Checkpointer` takes it
    (modules, optimizers, objects with ``state_dict``, tensors, and plain values such as a trainer's
    counters): agree on the newest ``step`` and give every rank that state from the lowest rank that
    applied it; returns that step.

    Unlike :func:`sync_state` the ranks need not hold the same tensors: a newcomer's optimizer has
    no state before its first step, and gets it here. Nothing is unpickled: the sender describes its
    state as a memory checkpoint's index (JSON, checked on each receiver by
    :func:`ftrt.checkpoint.memindex.check_index`) and sends its tensors as one buffer, which the
    receivers load as a restore would (:func:`ftrt.checkpoint.state.apply`). The state must not be
    sharded (DTensors: each rank holds a part only). ``wait`` as in :func:`sync_state`. Collective;
    every rank calls it with a state of the same structure. Raises :class:`~ftrt.errors.FtrtError`
    on every rank when a receiver could not take the sender's state (a model of another shape).

    ``prefer``: the rank that sends whenever it holds a state (``step >= 0``), also when another
    rank applied a newer step, which is then rolled back to it and trained again. A trainer whose
    rank 0 alone writes the record of each step prefers rank 0, so no step is recorded that the
    agreed state does not hold. Returns the sender's step (-1: no rank holds a state)."""
    import json

    import torch
    import torch.distributed as dist

    from ftrt.checkpoint import memtier
    from ftrt.checkpoint import state as st
    from ftrt.checkpoint.memindex import BadIndex, check_index
    from ftrt.errors import FtrtError

    done = _waiter(wait)
    applied = _applied_steps(step, done)
    src, me = _source(applied, prefer), dist.get_rank()
    agreed = applied[src]
    if all(a == agreed for a in applied):
        return agreed  # every rank holds it already: nothing to send
    length = torch.zeros(1, dtype=torch.int64)
    if me == src:
        flat, skeleton = memtier.flatten(st.to_dcp(state))
        if any(memtier._is_dtensor(t) for t in flat.values()):
            length.fill_(-1)  # every rank learns it and raises
        else:
            entries, size = memtier.layout(flat)
            index = {"step": agreed, "round": 0, "rank": 0, "world": 1, "slot": 0, "size": size,
                     "entries": entries, "skeleton": skeleton}
            raw = torch.frombuffer(bytearray(json.dumps(index, separators=(",", ":")).encode()), dtype=torch.uint8)
            length.fill_(raw.numel())
    done(dist.broadcast(length, src, async_op=True))
    if length.item() < 0:
        raise FtrtError(f"sync_state_dict cannot send rank {src}'s state: it is sharded (DTensors, each rank "
                        "holds a part only); restore it from the memory checkpoints instead.")
    if me != src:
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
    done(dist.broadcast(raw, src, async_op=True))
    error = ""
    try:
        index = check_index(json.loads(bytes(raw.numpy())))
    except (ValueError, BadIndex) as exc:  # a JSON error is a ValueError too
        index, error = None, f"the state rank {src} described is not usable: {exc}"
    buf = torch.empty(max(int(index["size"]) if index is not None else 1, 1), dtype=torch.uint8)
    if me == src:
        for e in index["entries"]:
            t = flat[e["key"]].detach()
            buf[e["offset"]:e["offset"] + e["nbytes"]].view(t.dtype).view(t.shape).copy_(t)
    done(dist.broadcast(buf, src, async_op=True))
    if me != src and index is not None:
        values = {e["key"]: buf[e["offset"]:e["offset"] + e["nbytes"]].view(memtier._dtype(e["dtype"]))
                  .view(e["local_shape"]) for e in index["entries"]}
        try:
            st.apply(state, memtier.unflatten(index["skeleton"], values))
        except (RuntimeError, KeyError, ValueError) as exc:  # torch's load errors: other names or shapes
            error = f"this rank's state does not take rank {src}'s: {str(exc)[:300]}"
    failed = torch.tensor([1 if error else 0], dtype=torch.int32)
    done(dist.all_reduce(failed, op=dist.ReduceOp.MAX, async_op=True))
    if failed.item():
        raise FtrtError(f"The ranks could not agree on the state of step {agreed}: "
                        f"{error or 'another rank could not take it'}.")
    return agreed


NAME_BYTES = 128
"""The longest name :func:`gather_names` carries (node ids are at most 128 characters)."""


def gather_names(name: str, *, wait: Callable[[Any], None] | None = None) -> list[str]:
    """Every rank's ``name`` (e.g. its node id), in rank order, over the default process group: one
    all-gather of fixed-size byte buffers, nothing unpickled. Each name received is checked as a
    node id (:func:`ftrt.jobkeys.check_id`: letters, digits, ``. _ -``, at most 128 characters) and
    raises :class:`~ftrt.errors.ConfigError` otherwise. ``wait`` as in :func:`sync_state`."""
    import torch
    import torch.distributed as dist

    from ftrt.jobkeys import check_id

    raw = check_id("node id", name).encode()
    mine = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    _waiter(wait)(dist.all_gather(out, mine, async_op=True))
    names = []
    for t in out:
        data = bytes(t.numpy()).rstrip(b"\0")
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            text = repr(data[:40])
        names.append(check_id("node id a peer sent", text))
    return names
