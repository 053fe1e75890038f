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

import logging
import threading
import time
import warnings
from typing import Any, Callable

from ftrt import _diag, reports
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.commit import Committer
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.signing import CheckpointKey
from ftrt.checkpoint import memtier
from ftrt.checkpoint import state as st
from ftrt.checkpoint.memrestore import MemoryRestore
from ftrt.checkpoint.saving import SaveHandle, SavePipeline, background_pool
from ftrt.checkpoint.staging import Stager
from ftrt.checkpoint.storage import (
    Location,
    brief,
    dcp_reader,
    list_steps,
    parse_url,
    step_dir,
)
from ftrt.errors import CheckpointCorrupt, CheckpointUnavailable, ConfigError

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 1.0
"""How long a restore that has a memory tier but no pointer waits for storage's listing before it
tries the memory tier (a listing that answers later is waited for only if memory cannot restore)."""

# DCP warns on every single-process save and load even when asked for one (no_dist=True).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
        self.mem_dir = mem_dir
        self._arena = memtier.Arena(mem_dir, self.rank) if mem_dir else None
        self._stager = Stager(staging_slots or (3 if mem_dir else 2))
        # Retention and pre-faulting staging slots: background work at a lower CPU priority.
        self._delete_pool = background_pool("ftrt-ckpt-delete", persist_nice)
        self._committer = Committer(self._group, self.loc, keep=keep, key=key, round_no=round_no,
                                    pre_commit=pre_commit, on_commit=on_commit, latest_limit=latest_limit,
                                    report=self._report, background=self._delete_pool)
        self._saving = SavePipeline(self._group, self.loc, stager=self._stager, arena=self._arena,
                                    committer=self._committer, background=self._delete_pool, report=self._report,
                                    round_no=round_no, retries=retries, retry_backoff=retry_backoff,
                                    thread_count=thread_count, persist_nice=persist_nice)
        self._memory = MemoryRestore(self._group, mem_dir) if mem_dir else None
        self.last_restore_tier: str | None = None
        self._closed = False
        if self.rank == 0 and self.loc.is_local:
            self.loc.fs.makedirs(self.loc.root, exist_ok=True)

    @property
    def has_memory_tier(self) -> bool:
        """True when saves also go to the node's memory tier (``save(..., persist=False)`` works)."""
        return self._arena is not None

    @property
    def skipped_saves(self) -> int:
        """Saves ``skip_if_busy`` turned into memory-only ones or skipped."""
        return self._saving.skipped_saves

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
        handle = self._saving.save(step, state, persist, skip_if_busy)
        handle.blocked_s += time.perf_counter() - t0
        return handle

    # -- restore --------------------------------------------------------------------------------
    def wait_pending(self) -> None:
        """Wait for every save started so far (failures are not raised here)."""
        self._saving.wait_pending()

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
        listing = _Listing(self.loc) if self.rank == 0 and (limit is None or self._memory is None) else None
        if self._memory is not None:
            # The memory tier first. The job's pointer names storage's newest trusted step, so storage's
            # listing is not waited for; without a pointer, a slow or unreachable storage holds the
            # restore up for LIST_TIMEOUT_S at most.
            newest = limit
            if newest is None:
                steps, _ = self._listed(listing, LIST_TIMEOUT_S)
                newest = max(steps or [], default=-1)
            got = self._memory.restore(state, newest_storage=newest)
            if got is not None:
                self.last_restore_tier = "memory"
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
        self._saving.close()
        self._delete_pool.shutdown(wait=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _report_to_agent(message: dict) -> None:
    """The default report: to this worker's agent under ``ftrt launch`` (a no-op elsewhere)."""
    from ftrt.runtime import init

    init().report(message)


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
