"""The save pipeline: stage a state off the training loop's hands, then persist it in the background.

1. :meth:`SavePipeline.save` resolves ``state`` to DCP's dict (references, no copy), snapshots the
   plain Python values, takes a staging slot (waiting if all are busy), queues the tensor copy on
   the staging thread and returns a :class:`SaveHandle` at once.
2. The staging thread copies the tensors into the slot's reusable buffers (with a memory tier the
   buffers are the slot of the rank's arena, :mod:`ftrt.checkpoint.memtier`, which then becomes
   the rank's current memory checkpoint and is reported as ``mem``); ``handle.wait_staged()``
   returns after that, and from then on the caller may change its tensors.
3. The persist thread writes the staged copy with ``dcp.save`` into ``step-<N>/`` on the
   checkpointer's own gloo group and hands the folder to the commit protocol
   (:mod:`ftrt.checkpoint.commit`). A failed attempt is retried (``retries`` times, backing off)
   after clearing the folder; a save that still fails raises from ``handle.wait()``, leaves no
   manifest, and does not stop training.

``skip_if_busy`` saves are decided by every rank alike (one small collective, the vote): while an
earlier save is still writing to storage, a save becomes a memory checkpoint only, or is skipped.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from typing import Any, Callable

from torch.distributed.checkpoint.api import CheckpointException

from ftrt import reports
from ftrt.checkpoint import memtier
from ftrt.checkpoint import state as st
from ftrt.checkpoint.commit import Committer
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.skeleton import Unencodable
from ftrt.checkpoint.staging import Stager
from ftrt.checkpoint.storage import Location, brief, dcp_writer, step_dir
from ftrt.errors import CheckpointSaveFailed, ConfigError, RoundChanged

log = logging.getLogger(__name__)


class SaveHandle:
    """The progress of one save."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._staged = threading.Event()
        self._future: cf.Future | None = None
        self.stage_s = 0.0
        self.persist_s = 0.0
        self.blocked_s = 0.0
        """Time the caller's thread spent in ``save()`` and ``wait_staged()`` for this save."""
        self.vote_wait_s = 0.0
        """Of :attr:`blocked_s`, the time the ``skip_if_busy`` vote waited for other ranks to get
        there (its wall time less the CPU time it took)."""
        self.background_cpu_s = 0.0
        """CPU time the checkpointer's own staging and persisting threads spent on this save."""
        self.persisting = False  # writes to storage (not a memory checkpoint only)
        self.skipped = False  # skip_if_busy skipped it: nothing was saved

    @property
    def cost_s(self) -> float:
        """What this save cost the training loop: the time it blocked the caller plus the CPU time
        of the background work (on a host whose cores are all busy training, that work takes
        them from training; where cores are idle it is an over-estimate). Final once
        :meth:`settled`.

        The vote's wait for slower ranks (:attr:`vote_wait_s`) is not a cost: the ranks of a
        data-parallel job meet at every step, so a rank that waits in the vote waits that much
        less at the step's next collective. Counting it would make ``auto`` cadences save less
        often the more the ranks' step times differ."""
        return max(self.blocked_s - self.vote_wait_s, 0.0) + self.background_cpu_s

    def settled(self) -> bool:
        """Whether :attr:`cost_s` is final: staged (a memory-only save) or done (a storage save)."""
        return self.done() if self.persisting else self._staged.is_set()

    @classmethod
    def skipped_at(cls, step: int) -> "SaveHandle":
        """A handle for a save that ``skip_if_busy`` skipped: done, nothing saved."""
        h = cls(step)
        h.skipped = True
        h._staged.set()
        h._future = cf.Future()
        h._future.set_result(None)
        return h

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once the state has been copied; the caller may then change its tensors."""
        t0 = time.perf_counter()
        ok = self._staged.wait(timeout)
        self.blocked_s += time.perf_counter() - t0
        if not ok:
            raise TimeoutError(f"Staging of step {self.step} did not finish within {timeout} s.")

    def wait(self, timeout: float | None = None) -> None:
        """Return once the checkpoint is committed; raise :class:`CheckpointSaveFailed` if it failed."""
        assert self._future is not None
        self._future.result(timeout)

    def done(self) -> bool:
        return self._future is not None and self._future.done()

    @property
    def error(self) -> BaseException | None:
        """The failure, once done; None while running or after success."""
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()


def background_pool(name: str, nice: int) -> cf.ThreadPoolExecutor:
    """One thread for background work (persisting, deleting) at ``nice`` more niceness, so that on
    a busy host it takes what the training loop leaves."""
    return cf.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,))


class SavePipeline:
    """Stages and persists one checkpointer's saves (see the module docstring).

    Args:
        group: the checkpointer's ranks.
        loc: where checkpoints are persisted.
        stager: the staging slots (with a memory tier, one per arena slot).
        arena: this rank's memory-tier arena, or None without a memory tier.
        committer: commits what a save persisted.
        background: the low-priority thread that pre-faults the spare staging slots.
        report: where ``mem`` reports go.
        round_no: the rendezvous round recorded in memory checkpoints.
        retries: attempts after the first when persisting fails.
        retry_backoff: seconds before the first retry, doubled for each next one.
        thread_count: DCP writer threads per rank.
        persist_nice: niceness added to the persist thread (Linux; 0 leaves it alone).
    """

    def __init__(self, group: CheckpointGroup, loc: Location, *, stager: Stager, arena: memtier.Arena | None,
                 committer: Committer, background: cf.ThreadPoolExecutor, report: Callable[[reports.Report], None],
                 round_no: int, retries: int, retry_backoff: float, thread_count: int, persist_nice: int) -> None:
        self._group = group
        self._loc = loc
        self._stager = stager
        self._arena = arena
        self._committer = committer
        self._background = background
        self._report = report
        self._round_no = round_no
        self._retries = retries
        self._retry_backoff = retry_backoff
        self._thread_count = thread_count
        self._state_dicts = st.StateDicts()  # fast to_dcp for every save
        self._stage_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ftrt-ckpt-stage")
        self._persist_pool = background_pool("ftrt-ckpt-persist", persist_nice)
        self._pending: list[SaveHandle] = []
        self._prewarmed = False
        self._closed = False
        self._retired = False
        """Set by :meth:`retire`: a save still in flight neither retries nor commits."""
        self.skipped_saves = 0
        """Saves ``skip_if_busy`` turned into memory-only ones or skipped."""

    def save(self, step: int, state: dict[str, Any], persist: bool, skip_if_busy: bool) -> SaveHandle:
        """Start a save (:meth:`ftrt.checkpoint.Checkpointer.save`); returns at once."""
        if self._closed:
            raise ConfigError("This Checkpointer is closed; create a new one to save again.")
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"The checkpoint step must be an int >= 0, got {step!r}.")
        if not persist and self._arena is None:
            raise ConfigError("save(persist=False) needs a memory tier (mem_dir, set under ftrt launch).")
        avoid = self._arena.current_slot() if self._arena is not None else None
        vote_wait = 0.0
        if skip_if_busy:
            writing = persist and any(h.persisting and not h.done() for h in self._pending)
            w0, c0 = time.perf_counter(), time.thread_time()
            # Also for memory-only saves: the collective is a barrier, so no rank's copy of this
            # step exists before every rank got here (a trainer's record of the step written
            # before saving, e.g. ftrt.grpo's metrics line, can then never be missing for a step
            # restore resumes after; the chaos ledger caught that once when it was skipped).
            writing, no_slot = self._group.any_rank(writing, not self._stager.has_free(avoid))
            vote_wait = max((time.perf_counter() - w0) - (time.thread_time() - c0), 0.0)
            if writing:
                log.info("checkpoint step %d: an earlier save is still writing to storage; %s", step,
                         "memory copy only" if self._arena is not None else "skipped")
                self.skipped_saves += 1
                if self._arena is None:
                    return SaveHandle.skipped_at(step)
                persist = False
            if not persist and no_slot:  # every other slot holds a save still being written
                log.info("checkpoint step %d: no free memory slot while storage is busy; skipped", step)
                self.skipped_saves += 1
                return SaveHandle.skipped_at(step)
        sd = self._state_dicts.to_dcp(state)
        if self._arena is None:
            sd = self._stager.snapshot_plain(sd)
        else:
            # Flattening rebuilds every non-tensor leaf as JSON values, so it is also the snapshot
            # of them that a save needs (the caller may change them right after); and it runs
            # here, not in the staging thread, since a state it cannot describe is the caller's error.
            try:
                sd = memtier.flatten(sd)
            except Unencodable as exc:
                raise ConfigError(str(exc)) from None
        slot = self._stager.acquire(avoid=avoid)
        handle = SaveHandle(step)
        handle.persisting = persist
        handle.vote_wait_s = vote_wait
        stage = self._stage if self._arena is None else self._stage_memory
        staged = self._stage_pool.submit(stage, slot, sd, handle, step)
        if not self._prewarmed:
            self._prewarmed = True
            staged.add_done_callback(lambda _: self._background.submit(self._stager.prewarm))
        if persist:
            handle._future = self._persist_pool.submit(self._persist, step, slot, staged, handle)
        else:
            handle._future = self._stage_pool.submit(self._memory_only_done, slot, staged)
        self._pending = [h for h in self._pending if not h.done()] + [handle]
        return handle

    def wait_pending(self) -> None:
        """Wait for every save started so far (failures are not raised here)."""
        for h in self._pending:
            if h._future is not None:
                cf.wait([h._future])
        self._pending = []

    def close(self) -> None:
        """Refuse further saves, wait for pending ones, stop the staging and persist threads."""
        self._closed = True
        self.wait_pending()
        self._stage_pool.shutdown(wait=True)
        self._persist_pool.shutdown(wait=True)

    def retire(self) -> None:
        """Refuse further saves and give up the pending ones without waiting for them: the group
        they run on is gone (the worker changed rounds in place). Waits only for staging (local
        copies; a new arena of this rank must not meet a copy still being written); a save still
        persisting ends on its own, without retrying or committing (its collectives fail on the
        left group, or wait out its timeout on a frozen peer, in its own thread)."""
        self._closed = self._retired = True
        self._stage_pool.shutdown(wait=True)
        self._persist_pool.shutdown(wait=False, cancel_futures=True)
        self._pending = []

    def _stage(self, slot: int, sd: Any, handle: SaveHandle, step: int) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._stager.stage(slot, sd)
        finally:
            handle.stage_s = time.perf_counter() - t0
            handle.background_cpu_s += time.thread_time() - c0
            handle._staged.set()

    def _stage_memory(self, slot: int, flattened: tuple[dict[str, Any], Any], handle: SaveHandle, step: int) -> Any:
        """Stage a flattened state (:func:`memtier.flatten`) into the arena's slot, then make it
        the rank's current memory checkpoint."""
        assert self._arena is not None
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            flat, skeleton = flattened
            entries, size = memtier.layout(flat)
            bufs = self._arena.buffers(slot, entries, size)
            staged: dict[str, Any] = {}
            for key, t in flat.items():
                local = t.to_local() if memtier._is_dtensor(t) else t
                bufs[key].copy_(local.detach(), non_blocking=local.is_cuda)
                staged[key] = bufs[key]
            if any(t.is_cuda for t in flat.values()):
                import torch

                torch.cuda.synchronize()
            self._arena.commit(slot=slot, step=step, round_no=self._round_no, world=self._group.world,
                               entries=entries, size=size, skeleton=skeleton)
            self._report(reports.MemorySaved(self._group.rank, step, size, time.perf_counter() - t0))
            for key, t in flat.items():
                if memtier._is_dtensor(t):
                    staged[key] = type(t).from_local(staged[key], t.device_mesh, t.placements, run_check=False,
                                                     shape=t.shape, stride=t.stride())
            return memtier.unflatten(skeleton, staged)
        finally:
            handle.stage_s = time.perf_counter() - t0
            handle.background_cpu_s += time.thread_time() - c0
            handle._staged.set()

    def _memory_only_done(self, slot: int, staged: cf.Future) -> None:
        try:
            staged.result()
        finally:
            self._stager.release(slot)

    def _persist(self, step: int, slot: int, staged: cf.Future, handle: SaveHandle) -> None:
        t0, c0 = time.perf_counter(), None
        try:
            sd = staged.result()
            c0 = time.thread_time()  # after the staging wait: only this save's own work counts
            folder = step_dir(step)
            if self._committer.already_committed(folder, step):
                log.info("checkpoint step %d is already committed; not saving it again", step)
                return
            error: BaseException | None = None
            attempts = 0
            for attempt in range(self._retries + 1):
                attempts = attempt + 1
                if self._retired:
                    error = error or RoundChanged("the checkpointer was retired (its worker changed rounds)")
                    break
                try:
                    written = self._attempt(folder, step, sd)
                    error = None
                    break
                except RoundChanged as exc:  # the job moved on: retrying cannot help
                    error = exc
                    break
                except (Exception, CheckpointException) as exc:  # storage errors: OSError, botocore, DCP's
                    # (DCP's CheckpointException, which wraps every rank's error, is a BaseException)
                    error = exc
                    if attempt < self._retries and not self._retired:
                        delay = self._retry_backoff * (2 ** attempt)
                        log.warning("checkpoint step %d: attempt %d failed (%s); retrying in %.1f s",
                                    step, attempt + 1, brief(exc), delay)
                        time.sleep(delay)
            if error is not None:
                raise CheckpointSaveFailed(
                    f"Checkpoint step {step} was not saved to {self._loc.url} after {attempts} "
                    f"attempt(s): {brief(error)}. Nothing was committed; training can go on."
                ) from error
            self._committer.committed(step, written, time.perf_counter() - t0)
        finally:
            self._stager.release(slot)
            handle.persist_s = time.perf_counter() - t0
            if c0 is not None:
                handle.background_cpu_s += time.thread_time() - c0

    def _attempt(self, folder: str, step: int, sd: Any) -> int:
        """One attempt: clear the folder, DCP save, commit (all ranks agree on each outcome).
        Returns the checkpoint's bytes on rank 0 (0 on the others)."""
        import torch.distributed.checkpoint as dcp

        g, loc = self._group, self._loc
        cleared = None
        if g.rank == 0:
            try:
                if loc.fs.exists(loc.path(folder)):
                    loc.fs.rm(loc.path(folder), recursive=True)  # leftovers of a failed attempt
            except Exception as exc:
                cleared = f"rank 0 could not clear {folder}: {brief(exc)}"
        cleared = g.broadcast(cleared)  # every rank learns the outcome: no one waits alone
        if cleared:
            raise OSError(cleared)
        writer = dcp_writer(loc, folder, self._thread_count)
        dcp.save(sd, storage_writer=writer, process_group=g.pg, no_dist=not g.distributed)
        if self._retired:  # written, but its round is over: never made a checkpoint
            raise RoundChanged(f"checkpoint step {step} was written after its checkpointer was retired")
        return self._committer.commit(folder, step)


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness (Linux threads are tasks; other threads keep theirs)."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        pass


__all__ = ["SaveHandle", "SavePipeline", "background_pool"]
