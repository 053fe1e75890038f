"""The :class:`Checkpointer`: sharded async saves with atomic checksummed commits, verified restore.

The public face of the checkpoint service. It builds its parts once, when constructed, and each
call goes to the one that does the work:

- :mod:`ftrt.checkpoint.saving`: ``save`` stages the state (``handle.wait_staged()``: the caller
  may change its tensors again) and persists it with DCP on a background thread, retrying;
- :mod:`ftrt.checkpoint.commit`: every rank's files become a checkpoint when rank 0 writes the
  manifest (and, under ``ftrt launch``, moves the job's pointer), old checkpoints are deleted;
- :mod:`ftrt.checkpoint.memrestore` and :mod:`ftrt.checkpoint.storagerestore`: ``restore`` tries
  the memory tier first (when there is one), then storage;
- :mod:`ftrt.checkpoint.group`: the ranks and the collectives they share.

Reports (:data:`ftrt.reports.CHECKPOINT_REPORTS`) go to the ``report`` callback alone; ``rt.checkpointer``
passes its worker's (:meth:`ftrt.runtime.Runtime.checkpointer`).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable

from ftrt import _diag, reports
from ftrt.checkpoint import memtier
from ftrt.checkpoint.commit import CommitFence, Committer
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.memrestore import MemoryRestore
from ftrt.checkpoint.saving import SaveHandle, SavePipeline, background_pool
from ftrt.checkpoint.signing import CheckpointKey
from ftrt.checkpoint.staging import Stager
from ftrt.checkpoint.storage import Location, parse_url
from ftrt.checkpoint.storagerestore import StorageRestore
from ftrt.errors import ConfigError

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 1.0
"""How long a restore that has a memory tier but no pointer waits for storage's listing before it
tries the memory tier (a listing that answers later is waited for only if memory cannot restore)."""

# DCP warns on every single-process save and load even when asked for one (no_dist=True).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class Checkpointer:
    """Sharded async checkpoints under one URL, in storage and (with ``mem_dir``) in node memory.

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
        retry_backoff: seconds before the first retry, doubled for each next one.
        thread_count: DCP writer threads per rank.
        fence: what fences commits to the job's rendezvous round and limits restores to the job's
            ``latest`` (:class:`~ftrt.checkpoint.commit.CommitFence`; ``rt.checkpointer`` passes the
            job's pointer under ``ftrt launch``); its round is recorded in every checkpoint. None:
            no fence, round 0, no limit.
        persist_nice: niceness added to the persistence thread (Linux; 0 leaves it alone).
        mem_dir: the node's memory-tier directory (under ``ftrt launch``: ``$FTRT_MEM_DIR``, kept
            by the agent). With it, every save is also a memory checkpoint and restore prefers the
            newest complete one (see :mod:`ftrt.checkpoint.memtier`).
        key: the job's checkpoint key (:mod:`ftrt.checkpoint.signing`): files are summed with
            SHA-256, manifests signed, and restore trusts only checkpoints signed under it.
            ``rt.checkpointer`` passes the launcher's ``--checkpoint-key-file`` (or
            ``$FTRT_CHECKPOINT_KEY``).
        report: where this rank's checkpoint reports go (:mod:`ftrt.reports`: ``MemorySaved``, a
            memory checkpoint is complete, which the agent replicates; ``Committed``: rank 0
            committed one to storage; ``Restored``: tier, step and seconds). Default: nowhere. ``rt.checkpointer`` passes
            :meth:`ftrt.runtime.Runtime.report` (this worker's agent under ``ftrt launch``); a
            checkpointer built by hand with ``mem_dir`` under ``ftrt launch`` needs it too, or
            the agent never hears of its memory checkpoints and does not replicate them.
        wait: how the training thread waits for its one collective (``skip_if_busy``'s vote),
            e.g. :meth:`ftrt.Runtime.wait` (``rt.checkpointer`` passes it in place); default:
            blocking.
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
        fence: CommitFence | None = None,
        persist_nice: int = 10,
        mem_dir: str | None = None,
        report: Callable[[reports.Report], None] | None = None,
        key: CheckpointKey | None = None,
        wait: Callable[[Any], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ConfigError(f"keep={keep}: a checkpointer must keep at least 1 checkpoint.")
        self.loc: Location = parse_url(url, storage_options)
        self.keep = keep
        self.key = key
        self.fence = fence
        self.round_no = fence.round_no if fence is not None else 0
        """The rendezvous round recorded in this checkpointer's checkpoints."""
        self.mem_dir = mem_dir
        self._report = report or _no_report
        self._group = CheckpointGroup(process_group, wait)
        self.distributed = self._group.distributed
        self.rank, self.world = self._group.rank, self._group.world
        self._arena = memtier.Arena(mem_dir, self.rank) if mem_dir else None
        self._stager = Stager(staging_slots or (3 if mem_dir else 2))
        # Retention and pre-faulting staging slots: background work at a lower CPU priority.
        self._delete_pool = background_pool("ftrt-ckpt-delete", persist_nice)
        self._committer = Committer(self._group, self.loc, keep=keep, key=key, fence=fence, report=self._report,
                                    background=self._delete_pool)
        self._saving = SavePipeline(self._group, self.loc, stager=self._stager, arena=self._arena,
                                    committer=self._committer, background=self._delete_pool, report=self._report,
                                    round_no=self.round_no, retries=retries, retry_backoff=retry_backoff,
                                    thread_count=thread_count, persist_nice=persist_nice)
        self._memory = MemoryRestore(self._group, mem_dir) if mem_dir else None
        self._storage = StorageRestore(self._group, self.loc, key)
        self.last_restore_tier: str | None = None
        """The tier the last successful restore loaded from (``"memory"`` or ``"storage"``), or None."""
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
        """Start a save of ``state`` as ``step``; returns at once (:mod:`ftrt.checkpoint.saving`).

        ``handle.wait_staged()`` returns once the state is copied (call it before
        ``optimizer.step()``); ``handle.wait()`` once it is committed, raising
        :class:`~ftrt.errors.CheckpointSaveFailed` if it could not be (training can go on).

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

    def wait_pending(self) -> None:
        """Wait for every save started so far (failures are not raised here)."""
        self._saving.wait_pending()

    # -- restore --------------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest verified checkpoint into ``state`` in place; return its step.

        With a memory tier, the newest memory checkpoint the job's nodes hold whole, if it is not
        older than storage's newest; else the newest checkpoint in storage that verifies (skipping
        damaged ones with a warning). Returns None when there is no checkpoint at all; raises
        :class:`~ftrt.errors.CheckpointCorrupt` when checkpoints exist but none verifies (the
        message lists why each was rejected), :class:`~ftrt.errors.CheckpointUnavailable` when
        storage cannot be read and memory cannot stand in.
        """
        t0 = time.perf_counter()
        step = self._restore(state)
        if step is not None:
            self._report(reports.Restored(self.rank, self.last_restore_tier, step, time.perf_counter() - t0))
        return step

    def _restore(self, state: dict[str, Any]) -> int | None:
        self.wait_pending()
        _diag.mark("restore.pointer")
        limit = self._group.broadcast(self.fence.latest() if self.rank == 0 and self.fence is not None else None)
        # Only rank 0 lists; with a pointer and a memory tier, storage is listed only if memory fails.
        listing = self._storage.listing() if limit is None or self._memory is None else None
        if self._memory is not None:
            # The memory tier first. The job's pointer names storage's newest trusted step, so storage's
            # listing is not waited for; without a pointer, a slow or unreachable storage holds the
            # restore up for LIST_TIMEOUT_S at most.
            newest = limit
            if newest is None:
                steps, _ = self._storage.listed(listing, LIST_TIMEOUT_S)
                newest = max(steps or [], default=-1)
            got = self._memory.restore(state, newest_storage=newest)
            if got is not None:
                self.last_restore_tier = "memory"
                return got
        if listing is None:
            listing = self._storage.listing()
        step = self._storage.restore(state, listing, limit)
        if step is not None:
            self.last_restore_tier = "storage"
        return step

    # -- lifecycle ------------------------------------------------------------------------------
    def retire(self) -> None:
        """Stop this checkpointer without waiting for its pending saves, when its worker changed
        rounds in place (:meth:`ftrt.Runtime.reconfigure`): its process groups were made from the old
        round's group, and its commits are fenced by the old round, so it can neither save nor commit
        again. A save still in flight ends on its own thread, never retried and never committed; only
        its staging (local copies) is waited for. Build a new one (``rt.checkpointer(...)``, on every
        rank alike) after the new group is up. Idempotent; :meth:`close` after it does nothing."""
        if self._closed:
            return
        self._closed = True
        self._saving.retire()
        self._delete_pool.shutdown(wait=False, cancel_futures=True)

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


def _no_report(message: reports.Report) -> None:
    """The default ``report``: nowhere."""


__all__ = ["Checkpointer", "SaveHandle"]
