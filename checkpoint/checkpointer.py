"""The :class:`Checkpointer`: sharded async saves with atomic checksummed commits, verified restore.

Save = stage, then persist:

1. ``save(step, state)`` resolves ``state`` to DCP's dict (references, no copy), deep-copies the
   plain Python values, takes a staging slot (waiting if all are busy), queues the tensor copy on
   the staging thread and returns a :class:`SaveHandle` at once.
2. The staging thread copies tensors into the slot's reusable buffers; ``handle.wait_staged()``
   returns after that, and from then on the caller may change its tensors (call it before
   ``optimizer.step()``).
3. The persist thread writes the staged copy with ``dcp.save`` into ``step-<N>/`` on a process
   group of its own (gloo), so its collectives never meet the training loop's. Then every rank
   checksums the files it wrote, rank 0 gathers the sizes and checksums and writes
   ``manifest.json`` last: the checkpoint exists from that moment on. Storage errors are retried
   (``retries`` times, backing off); a save that still fails raises from ``handle.wait()``,
   leaves no manifest, and does not stop training.
4. Rank 0 then deletes checkpoints beyond the newest ``keep`` and abandoned folders, on a thread
   of its own.

``restore(state)`` takes the newest checkpoint whose manifest is valid and whose files all match
their sizes and checksums (ranks verify disjoint shares in parallel), skipping damaged ones with a
warning, and loads it in place with ``dcp.load`` (which reshards DTensors to the current world).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
import warnings
from typing import Any, Callable

import torch.distributed as dist

from ftrt import _diag, reports
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.commit import Committer
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.signing import CheckpointKey
from ftrt.checkpoint import memtier
from ftrt.checkpoint import state as st
from ftrt.checkpoint.skeleton import Unencodable
from ftrt.checkpoint.staging import Stager
from ftrt.checkpoint.storage import (
    Location,
    brief,
    dcp_reader,
    dcp_writer,
    list_steps,
    parse_url,
    step_dir,
)
from ftrt.errors import CheckpointCorrupt, CheckpointSaveFailed, CheckpointUnavailable, ConfigError, RoundChanged

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 1.0
"""How long a restore that has a memory tier but no pointer waits for storage's listing before it
tries the memory tier (a listing that answers later is waited for only if memory cannot restore)."""

# DCP warns on every single-process save and load even when asked for one (no_dist=True).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
        self.background_cpu_s = 0.0
        """CPU time the checkpointer's own staging and persisting threads spent on this save."""
        self.persisting = False  # writes to storage (not a memory checkpoint only)
        self.skipped = False  # skip_if_busy skipped it: nothing was saved

    @property
    def cost_s(self) -> float:
        """What this save cost the training loop: the time it blocked the caller plus the CPU time
        of the background work (on a host whose cores are all busy training, that work takes
        them from training; where cores are idle it is an over-estimate). Final once
        :meth:`settled`."""
        return self.blocked_s + self.background_cpu_s

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


class Checkpointer:
    """Sharded async checkpoints under one URL. See the module docstring.

    Args:
        url: local path, ``file://``, ``s3://bucket/prefix`` or ``memory://name``.
        keep: committed checkpoints to keep (the newest valid one is never deleted).
        storage_options: fsspec options (for S3: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``); the usual environment variables work too.
        process_group: ranks taking part (default: the whole world if torch.distributed is
            initialised, else this process alone). Must be created on every rank alike.
        staging_slots: staged copies that may wait for persistence at once (host memory bound);
            default 2, or 3 with a memory tier: the newest memory checkpoint, the next one being
            written, and one still being persisted to storage, so that memory checkpoints every
            step never wait for (or skip because of) a storage save.
        retries: attempts after the first when persisting fails.
        thread_count: DCP writer threads per rank.
        on_commit: called as ``on_commit(step)`` on rank 0 after a manifest is written (the
            runtime uses it to move the job's ``latest`` pointer). If it raises
            :class:`~ftrt.errors.RoundChanged` the manifest is withdrawn and the save fails.
        pre_commit: called on rank 0 just before the manifest is written; raising
            :class:`~ftrt.errors.RoundChanged` stops the commit.
        latest_limit: called at restore; returns the highest step allowed (the job's pointer),
            or None for no limit.
        persist_nice: niceness added to the persistence thread (Linux; 0 leaves it alone).
        mem_dir: the node's memory-tier directory (under ``ftrt launch``: ``$FTRT_MEM_DIR``, kept
            by the agent). With it, every save is also a memory checkpoint and restore prefers the
            newest complete one (see :mod:`ftrt.checkpoint.memtier`).
        key: the job's checkpoint key (:mod:`ftrt.checkpoint.signing`): files are summed with
            SHA-256, manifests signed, and restore trusts only checkpoints signed under it.
            ``rt.checkpointer`` passes the launcher's ``--checkpoint-key-file`` (or
            ``$FTRT_CHECKPOINT_KEY``).
        report: where this rank's checkpoint reports go, as dicts (``mem``: a memory checkpoint is
            complete, which the agent replicates; ``ckpt``: rank 0 committed one to storage;
            ``restore``: tier, step and seconds). Default: this worker's agent under ``ftrt
            launch`` (:meth:`ftrt.runtime.Runtime.report`), nowhere elsewhere.
    """

    def __init__(
        self,
        url: str,
        keep: int = 3,
        storage_options: dict | None = None,
        *,
        process_group: Any = None,
        staging_slots: int | None = None,
        retries: int = 3,
        retry_backoff: float = 0.5,
        thread_count: int = 2,
        on_commit: Callable[[int], None] | None = None,
        pre_commit: Callable[[], None] | None = None,
        latest_limit: Callable[[], int | None] | None = None,
        round_no: int = 0,
        persist_nice: int = 10,
        mem_dir: str | None = None,
        report: Callable[[dict], None] | None = None,
        key: CheckpointKey | None = None,
    ) -> None:
        if keep < 1:
            raise ConfigError(f"keep={keep}: a checkpointer must keep at least 1 checkpoint.")
        self.loc: Location = parse_url(url, storage_options)
        self.keep = keep
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.thread_count = thread_count
        self.latest_limit = latest_limit
        self.round_no = round_no
        self._report = report or _report_to_agent
        self.key = key
        self._group = CheckpointGroup(process_group)
        self.distributed = self._group.distributed
        self.rank, self.world = self._group.rank, self._group.world
        self._pg = self._group.pg
        self._stager = Stager(staging_slots or (3 if mem_dir else 2))
        self._state_dicts = st.StateDicts()  # fast to_dcp for every save
        self._stage_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ftrt-ckpt-stage")
        # Persistence and deletion are background work: their threads run at a lower CPU priority
        # so that on a busy host they take what the training loop leaves.
        self._persist_pool = cf.ThreadPoolExecutor(
            1, thread_name_prefix="ftrt-ckpt-persist", initializer=_lower_priority, initargs=(persist_nice,)
        )
        self._delete_pool = cf.ThreadPoolExecutor(
            1, thread_name_prefix="ftrt-ckpt-delete", initializer=_lower_priority, initargs=(persist_nice,)
        )
        self._committer = Committer(self._group, self.loc, keep=keep, key=key, round_no=round_no,
                                    pre_commit=pre_commit, on_commit=on_commit, latest_limit=latest_limit,
                                    report=self._report, background=self._delete_pool)
        self._pending: list[SaveHandle] = []
        self._prewarmed = False
        self.mem_dir = mem_dir
        self._arena = memtier.Arena(mem_dir, self.rank) if mem_dir else None
        self.last_restore_tier: str | None = None
        self._closed = False
        self.skipped_saves = 0  # saves skip_if_busy turned into memory-only ones or skipped
        if self.rank == 0 and self.loc.is_local:
            self.loc.fs.makedirs(self.loc.root, exist_ok=True)

    @property
    def has_memory_tier(self) -> bool:
        """True when saves also go to the node's memory tier (``save(..., persist=False)`` works)."""
        return self._arena is not None

    @property
    def last_committed(self) -> int | None:
        """The step this process last saw committed to storage, or None."""
        return self._committer.last_committed

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, persist: bool = True,
             skip_if_busy: bool = False) -> SaveHandle:
        """Start a save of ``state`` as ``step``; returns at once (see the module docstring).

        ``persist=False`` makes a memory checkpoint only (needs ``mem_dir``): no storage write, the
        handle completes once the copy is in the arena. Cheap enough to take every step.

        ``skip_if_busy=True``: when an earlier storage save is still running on any rank (slow or
        failing storage), this one does not queue behind it, which would soon make training wait
        for a staging slot; it is a memory checkpoint only (with a memory tier) or skipped
        (``handle.skipped``). A memory checkpoint whose slot is still being written to storage is
        skipped too (the newest complete one stays). Every rank must pass the same value: the ranks
        agree with one small collective, so all of them skip or none does.
        """
        t0 = time.perf_counter()
        handle = self._save(step, state, persist, skip_if_busy)
        handle.blocked_s += time.perf_counter() - t0
        return handle

    def _save(self, step: int, state: dict[str, Any], persist: bool, skip_if_busy: bool) -> SaveHandle:
        if self._closed:
            raise ConfigError("This Checkpointer is closed; create a new one to save again.")
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"The checkpoint step must be an int >= 0, got {step!r}.")
        if not persist and self._arena is None:
            raise ConfigError("save(persist=False) needs a memory tier (mem_dir, set under ftrt launch).")
        avoid = self._arena.current_slot() if self._arena is not None else None
        if skip_if_busy:
            writing = persist and any(h.persisting and not h.done() for h in self._pending)
            # Also for memory-only saves: the collective is a barrier, so no rank's copy of this
            # step exists before every rank got here (a trainer's record of the step written
            # before saving, e.g. ftrt.grpo's metrics line, can then never be missing for a step
            # restore resumes after; the chaos ledger caught that once when it was skipped).
            writing, no_slot = self._group.any_rank(writing, not self._stager.has_free(avoid))
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
        stage = self._stage if self._arena is None else self._stage_memory
        staged = self._stage_pool.submit(stage, slot, sd, handle, step)
        if not self._prewarmed:
            self._prewarmed = True
            staged.add_done_callback(lambda _: self._delete_pool.submit(self._stager.prewarm))
        if persist:
            handle._future = self._persist_pool.submit(self._persist, step, slot, staged, handle)
        else:
            handle._future = self._stage_pool.submit(self._memory_only_done, slot, staged)
        self._pending = [h for h in self._pending if not h.done()] + [handle]
        return handle

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
            self._arena.commit(slot=slot, step=step, round_no=self.round_no, world=self.world,
                               entries=entries, size=size, skeleton=skeleton)
            self._report(reports.memory_saved(self.rank, step, size, time.perf_counter() - t0))
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
            for attempt in range(self.retries + 1):
                attempts = attempt + 1
                try:
                    written = self._write(folder, step, sd)
                    error = None
                    break
                except RoundChanged as exc:  # the job moved on: retrying cannot help
                    error = exc
                    break
                except Exception as exc:  # storage errors come in many types (OSError, botocore, DCP's)
                    error = exc
                    if attempt < self.retries:
                        delay = self.retry_backoff * (2 ** attempt)
                        log.warning("checkpoint step %d: attempt %d failed (%s); retrying in %.1f s",
                                    step, attempt + 1, brief(exc), delay)
                        time.sleep(delay)
            if error is not None:
                raise CheckpointSaveFailed(
                    f"Checkpoint step {step} was not saved to {self.loc.url} after {attempts} "
                    f"attempt(s): {brief(error)}. Nothing was committed; training can go on."
                ) from error
            self._committer.committed(step, written, time.perf_counter() - t0)
        finally:
            self._stager.release(slot)
            handle.persist_s = time.perf_counter() - t0
            if c0 is not None:
                handle.background_cpu_s += time.thread_time() - c0

    def _write(self, folder: str, step: int, sd: Any) -> int:
        """One attempt: DCP save, checksums, manifest (rank 0), all ranks agree on the outcome.
        Returns the checkpoint's bytes on rank 0 (0 on the others)."""
        import torch.distributed.checkpoint as dcp

        cleared = None
        if self.rank == 0:
            try:
                if self.loc.fs.exists(self.loc.path(folder)):
                    self.loc.fs.rm(self.loc.path(folder), recursive=True)  # leftovers of a failed attempt
            except Exception as exc:
                cleared = f"rank 0 could not clear {folder}: {brief(exc)}"
        cleared = self._group.broadcast(cleared)  # every rank learns the outcome: no one waits alone
        if cleared:
            raise OSError(cleared)
        writer = dcp_writer(self.loc, folder, self.thread_count)
        dcp.save(sd, storage_writer=writer, process_group=self._pg, no_dist=not self.distributed)
        return self._committer.commit(folder, step)

    # -- restore --------------------------------------------------------------------------------
    def wait_pending(self) -> None:
        """Wait for every save started so far (failures are not raised here)."""
        for h in self._pending:
            if h._future is not None:
                cf.wait([h._future])
        self._pending = []

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest verified checkpoint into ``state`` in place; return its step.

        Returns None when there is no checkpoint at all; raises :class:`CheckpointCorrupt` when
        checkpoints exist but none verifies (the message lists why each was rejected).
        """
        t0 = time.perf_counter()
        step = self._restore(state)
        if step is not None:
            self._report(reports.restored(self.rank, self.last_restore_tier, step, time.perf_counter() - t0))
        return step

    def _restore(self, state: dict[str, Any]) -> int | None:
        import torch.distributed.checkpoint as dcp

        self.wait_pending()
        _diag.mark("restore.pointer")
        limit = self._group.broadcast(self.latest_limit() if self.rank == 0 and self.latest_limit is not None else None)
        # Only rank 0 lists; with a pointer and a memory tier, storage is listed only if memory fails.
        listing = _Listing(self.loc) if self.rank == 0 and (limit is None or self._arena is None) else None
        if self._arena is not None:
            # The memory tier first. The job's pointer names storage's newest trusted step, so storage's
            # listing is not waited for; without a pointer, a slow or unreachable storage holds the
            # restore up for LIST_TIMEOUT_S at most.
            newest = limit
            if newest is None:
                steps, _ = self._listed(listing, LIST_TIMEOUT_S)
                newest = max(steps or [], default=-1)
            got = self._restore_memory(state, newest_storage=newest)
            if got is not None:
                return got
        if listing is None and self.rank == 0:
            listing = _Listing(self.loc)
        steps, storage_error = self._listed(listing, None)
        if storage_error is not None:
            raise CheckpointUnavailable(
                f"Cannot restore: listing the checkpoints in {self.loc.url} failed ({brief(storage_error)}) "
                f"and no memory checkpoint covers this job. Check that the storage is reachable; the "
                f"checkpoints there are untouched."
            ) from storage_error
        rejected: list[str] = []
        for step in reversed(steps):
            folder = step_dir(step)
            if limit is not None and step > limit:
                rejected.append(f"step {step}: newer than the job's committed pointer (step {limit})")
                continue
            reason = self._verify(folder)
            if reason:
                log.warning("skipping checkpoint %s: %s", folder, reason)
                rejected.append(f"step {step}: {reason}")
                continue
            target = st.to_dcp(state)
            dcp.load(target, storage_reader=dcp_reader(self.loc, folder), process_group=self._pg,
                     no_dist=not self.distributed)
            st.apply(state, target)
            log.info("restored checkpoint step %d from %s", step, self.loc.url)
            self.last_restore_tier = "storage"
            return step
        if rejected:
            raise CheckpointCorrupt(
                f"No valid checkpoint under {self.loc.url}: " + "; ".join(rejected) + "."
            )
        return None

    def _listed(self, listing: "_Listing | None", timeout: float | None
                ) -> tuple[list[int] | None, BaseException | None]:
        """Storage's steps as rank 0's ``listing`` found them (collective): (steps, None) or (None, the
        error); a listing still running after ``timeout`` seconds is a TimeoutError for now."""
        found = listing.wait(timeout) if listing is not None else None
        if listing is not None:
            _diag.mark("restore.listed")
        steps, error = self._group.broadcast(found)
        if error is not None:
            log.warning("cannot list the checkpoints in %s (%s)", self.loc.url, brief(error))
        return steps, error

    def _restore_memory(self, state: dict[str, Any], newest_storage: int) -> int | None:
        """Restore from the newest complete memory checkpoint held by this job's nodes, if it is at
        least as new as storage's. Collective; every rank returns the same answer."""
        import torch

        mine = memtier.scan(self.mem_dir)
        held = self._group.all_gather([{k: v for k, v in m.items() if k != "file"} for m in mine])
        pick = memtier.choose(held)
        if pick is None or pick[0] < newest_storage:
            (log.warning if any(held) else log.debug)(
                "memory tier not used: %s (storage's newest: step %s; the nodes hold %s)",
                "no step is held whole" if pick is None else f"its newest whole step {pick[0]} is older",
                newest_storage if newest_storage >= 0 else "none", memtier.describe(held))
            return None
        step, rnd, world, holders = pick
        _diag.mark("restore.memory.chosen")
        indexes = self._group.all_gather({m["rank"]: m for m in mine if (m["step"], m["round"], m["world"]) == (step, rnd, world)})
        old = {r: indexes[h][r] for r, h in holders.items()}
        target = st.to_dcp(state)
        t_flat, _ = memtier.flatten(target)
        local = {r: m for r, m in indexes[self.rank].items()}
        arenas = {r: torch.from_file(m["file"], shared=False, size=m["size"], dtype=torch.uint8) for r, m in local.items()}
        try:
            need = memtier.needed_ranks(t_flat, old, set(local))
            error = None
        except memtier.Unsupported as exc:
            need, error = set(), str(exc)
        needs = self._group.all_gather((sorted(need), error))
        errors = [e for _, e in needs if e]
        if errors:
            log.warning("memory tier cannot restore this state (%s); using storage", errors[0])
            return None
        for r in sorted(holders):
            holder = holders[r]
            if not any(r in n and i != holder for i, (n, _) in enumerate(needs)):
                continue
            buf = arenas[r] if self.rank == holder else torch.empty(old[r]["size"], dtype=torch.uint8)
            dist.broadcast(buf, src=dist.get_global_rank(self._pg, holder), group=self._pg)
            if r in needs[self.rank][0]:
                arenas[r] = buf
        _diag.mark("restore.memory.fetched")
        try:
            memtier.fill(t_flat, old, arenas, files={r: m["file"] for r, m in local.items()})
            error = None
        except memtier.Unsupported as exc:
            error = str(exc)
        errors = [e for e in self._group.all_gather(error) if e]
        if errors:
            log.warning("memory tier could not restore (%s); using storage", errors[0])
            return None
        _diag.mark("restore.memory.filled")
        loaded = memtier.unflatten(old[min(old)]["skeleton"], t_flat)
        st.apply(state, loaded)
        log.info("restored checkpoint step %d from memory (saved by %d ranks in round %d)", step, world, rnd)
        self.last_restore_tier = "memory"
        return step

    def _verify(self, folder: str) -> str | None:
        """None if the checkpoint verifies on every rank, else the first reason found."""
        found: Any
        if self.rank == 0:
            try:
                found = mf.read_manifest(self.loc, folder, self.key)
            except CheckpointCorrupt as exc:
                found = str(exc)
        else:
            found = None
        found = self._group.broadcast(found)
        if isinstance(found, str):
            return found
        names = sorted(found.files)
        share = names[self.rank::self.world]
        try:
            mf.verify_files(self.loc, folder, found, share)
            mine = None
        except CheckpointCorrupt as exc:
            mine = str(exc)
        except Exception as exc:
            mine = f"could not read files: {brief(exc)}"
        reasons = [r for r in self._group.all_gather(mine) if r]
        return reasons[0] if reasons else None

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending saves, stop background threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait_pending()
        self._stage_pool.shutdown(wait=True)
        self._persist_pool.shutdown(wait=True)
        self._delete_pool.shutdown(wait=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _report_to_agent(message: dict) -> None:
    """The default report: to this worker's agent under ``ftrt launch`` (a no-op elsewhere)."""
    from ftrt.runtime import init

    init().report(message)


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness (Linux threads are tasks; other threads keep theirs)."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        pass


__all__ = ["Checkpointer", "SaveHandle"]


class _Listing:
    """Storage's steps, listed on a daemon thread from construction: a restore may try the memory tier
    while a slow storage answers, and waits for the same listing later if it needs it."""

    def __init__(self, loc: Location) -> None:
        self._done = threading.Event()
        self._found: tuple[list[int] | None, BaseException | None] = (None, None)
        threading.Thread(target=self._run, args=(loc,), name="ftrt-list-checkpoints", daemon=True).start()

    def _run(self, loc: Location) -> None:
        try:
            self._found = (list_steps(loc), None)
        except Exception as exc:  # storage down: the memory tier may not need it
            self._found = (None, exc)
        self._done.set()

    def wait(self, timeout: float | None) -> tuple[list[int] | None, BaseException | None]:
        """(steps, None), (None, the listing's error), or (None, TimeoutError) while it still runs."""
        if not self._done.wait(timeout):
            return None, TimeoutError(f"the storage did not answer in {timeout:g} s")
        return self._found
