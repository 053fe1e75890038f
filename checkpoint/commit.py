"""The commit protocol: a checkpoint's files become a checkpoint, and old ones go.

Once every rank's DCP files of a step are written (:mod:`ftrt.checkpoint.saving`):

1. every rank sums the files it wrote (CRC-32, or SHA-256 with a checkpoint key);
2. rank 0 gathers the sizes and sums, asks the :class:`CommitFence` whether the round may commit
   (under ``ftrt launch``: is our round still the job's?), and writes ``manifest.json`` last,
   signed with the key if there is one: the checkpoint exists from that moment on;
3. rank 0 commits through the fence (under ``ftrt launch``: moves the job's ``latest`` pointer in
   etcd, fenced by the round); if the round moved on, the manifest is withdrawn again, since a
   stale round's checkpoint must not exist;
4. every rank learns the outcome from rank 0, so all of them succeed or fail together.

After a commit rank 0 reports it (``ckpt``) and deletes, on the background thread, the committed
checkpoints beyond the newest ``keep`` and the folders of saves that never committed.

Folders written by someone else (a trainer's own checkpoint folder, DCP's writer) are committed
the same way by one process, :func:`commit_folder`, and found again by :func:`newest_verified`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Callable, Protocol

from ftrt import reports
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.signing import CheckpointKey
from ftrt.checkpoint.storage import MANIFEST, Location, brief, list_steps, step_dir, write_bytes
from ftrt.errors import CheckpointCorrupt, RoundChanged

log = logging.getLogger(__name__)


class CommitFence(Protocol):
    """What fences a commit to the job's rendezvous round: asked before the manifest is written,
    told after, asked at restore. Under ``ftrt launch`` it is the job's ``latest`` pointer in etcd
    (:class:`~ftrt.checkpoint.pointer.LatestPointer`); every method runs on rank 0 only."""

    round_no: int
    """The round whose checkpoints it fences (recorded in their manifests)."""

    def check_round(self) -> None:
        """Raise :class:`~ftrt.errors.RoundChanged` if the round may no longer commit."""

    def commit(self, step: int) -> None:
        """Make ``step`` the job's latest checkpoint; :class:`~ftrt.errors.RoundChanged` if the round
        moved on (the manifest is then withdrawn)."""

    def latest(self) -> int | None:
        """The newest step the job trusts, or None for no limit."""


def commit_folder(loc: Location, folder: str, step: int, world_size: int, *, fence: CommitFence | None = None,
                  key: CheckpointKey | None = None, extra: dict | None = None) -> mf.Manifest:
    """Commit ``loc``'s ``folder``, whose files are all written, as ``step``: check the round
    (``fence``), sum every file (CRC-32; SHA-256 and a signed manifest with ``key``), write the
    manifest last (recording the fence's round), commit through ``fence``. A :class:`RoundChanged`
    withdraws the manifest. Files with ``.tmp`` in their name are in-flight writes and not part of
    the checkpoint."""
    if fence is not None:
        fence.check_round()  # a stale round writes no manifest at all
    checksum = "sha256" if key is not None else "crc32"
    root = loc.path(folder)
    files = {}
    for path in sorted(loc.fs.find(root)):
        rel = path[len(root):].lstrip("/")
        if rel != MANIFEST and ".tmp" not in rel:
            files[rel] = mf.checksum_file(loc, path, checksum)
    manifest = mf.Manifest(step=step, world_size=world_size, files=files, checksum=checksum,
                           round=fence.round_no if fence is not None else 0, time=time.time(), extra=dict(extra or {}))
    if key is not None:
        manifest = manifest.signed(key)
    path = loc.path(folder, MANIFEST)
    write_bytes(loc, path, manifest.to_json())
    if fence is not None:
        try:
            fence.commit(step)
        except RoundChanged:
            loc.fs.rm(path)  # a stale round's checkpoint must not exist
            raise
    return manifest


def newest_verified(loc: Location, steps, name_of: Callable[[int], str], *, latest: int | None,
                    key: CheckpointKey | None = None, accept: Callable[[str], str | None] | None = None
                    ) -> int | None:
    """The newest of ``steps`` whose folder (``name_of(step)``) holds a manifest that every file
    matches (signed under ``key`` when given), not newer than ``latest``, and that ``accept``
    (called with the folder, after the check) does not pass over by giving a reason; or None.
    Each one passed over is logged with why."""
    for step in sorted(steps, reverse=True):
        folder = name_of(step)
        if latest is not None and step > latest:
            log.warning("not using %s: newer than the job's latest committed checkpoint (%d)", folder, latest)
            continue
        try:
            mf.verify_step(loc, folder, key, name_of=name_of)
        except CheckpointCorrupt as exc:
            log.warning("not using %s: %s", folder, exc)
            continue
        reason = accept(folder) if accept is not None else None
        if reason is not None:
            log.warning("not using %s: %s", folder, reason)
            continue
        return step
    return None


class Committer:
    """Commits, recognises and retires one checkpointer's checkpoints (see the module docstring).

    Args:
        group: the checkpointer's ranks.
        loc: where its checkpoints live.
        keep: committed checkpoints to keep (>= 1; the newest valid one is never deleted).
        key: the job's checkpoint key: files summed with SHA-256 and manifests signed; a
            manifest not signed under it is not this job's (kept, never trusted).
        fence: the :class:`CommitFence` of the job's round (None: round 0, nothing fenced, no limit).
        report: where rank 0's ``ckpt`` reports go.
        background: the low-priority thread retention runs on.
    """

    def __init__(self, group: CheckpointGroup, loc: Location, *, keep: int, key: CheckpointKey | None,
                 fence: CommitFence | None, report: Callable[[reports.Report], None],
                 background: cf.ThreadPoolExecutor) -> None:
        self._group = group
        self._loc = loc
        self._keep = keep
        self._key = key
        self._fence = fence
        self._report = report
        self._background = background
        self.checksum = "sha256" if key is not None else "crc32"
        """How this job sums its files."""
        self.last_committed: int | None = None
        """The step this process last saw committed to storage, or None."""

    def already_committed(self, folder: str, step: int) -> bool:
        """Whether ``step`` is committed in ``folder`` and trusted (not above the job's pointer), as
        rank 0 finds it; collective. "Cannot tell" (storage or etcd down) reads as no: the save
        attempt that follows reports the failure."""
        found = None
        if self._group.rank == 0:
            try:
                found = self.is_committed(folder)
                if found:
                    # Above the job's pointer a manifest is not trusted (a stale round may have left it).
                    limit = self._fence.latest() if self._fence is not None else None
                    found = limit is None or step <= limit
            except Exception:
                found = False
        return bool(self._group.broadcast(found))

    def commit(self, folder: str, step: int) -> int:
        """Commit the files every rank wrote into ``folder`` as ``step``; collective. Returns the
        checkpoint's bytes on rank 0 (0 on the others); raises :class:`RoundChanged` if the job's
        round moved on and OSError for any other failure, on every rank alike."""
        g, loc = self._group, self._loc
        mine: dict[str, mf.FileEntry] | str
        try:
            names = [p.rsplit("/", 1)[-1] for p in loc.fs.ls(loc.path(folder), detail=False)]
            own = [n for n in names if n.startswith(f"__{g.rank}_") or (g.rank == 0 and n == ".metadata")]
            mine = {n: mf.checksum_file(loc, loc.path(folder, n), self.checksum) for n in own}
        except Exception as exc:
            mine = f"rank {g.rank}: {brief(exc)}"
        parts = g.all_gather(mine)
        failures = [p for p in parts if isinstance(p, str)]
        if failures:
            raise OSError("; ".join(failures))
        outcome = None
        files: dict[str, mf.FileEntry] = {}
        if g.rank == 0:
            for p in parts:
                files.update(p)
            outcome = self._write_manifest(folder, step, files)
        outcome = g.broadcast(outcome)
        if outcome:
            kind, message = outcome
            raise RoundChanged(message) if kind == "round" else OSError(message)
        return sum(e.size for e in files.values()) if g.rank == 0 else 0

    def _write_manifest(self, folder: str, step: int, files: dict[str, mf.FileEntry]) -> tuple[str, str] | None:
        """Rank 0's part of a commit: None, or ("round" | "error", why it failed)."""
        m = mf.Manifest(step=step, world_size=self._group.world, files=files,
                        round=self._fence.round_no if self._fence is not None else 0, time=time.time(),
                        checksum=self.checksum)
        if self._key is not None:
            m = m.signed(self._key)
        manifest_path = self._loc.path(folder, MANIFEST)
        try:
            if self._fence is not None:
                self._fence.check_round()
            write_bytes(self._loc, manifest_path, m.to_json())
            if self._fence is not None:
                try:
                    self._fence.commit(step)
                except RoundChanged:
                    self._loc.fs.rm(manifest_path)  # withdraw: a stale round's checkpoint must not exist
                    raise
        except RoundChanged as exc:
            return ("round", str(exc))
        except Exception as exc:
            return ("error", f"rank 0 could not commit: {brief(exc)}")
        return None

    def committed(self, step: int, nbytes: int, save_s: float) -> None:
        """Record that ``step`` was committed (``nbytes`` in all, ``save_s`` after its staging): on rank
        0, report it and start retention."""
        self.last_committed = step
        if self._group.rank == 0:
            self._background.submit(self.retain)
            self._report(reports.Committed("storage", 0, step, nbytes, save_s))

    def retain(self) -> None:
        """Delete all but the newest ``keep`` committed checkpoints, and dead uncommitted folders."""
        try:
            steps = list_steps(self._loc)
            committed = [s for s in steps if self.is_committed(step_dir(s))]
            keep = set(committed[-self._keep:])
            newest = committed[-1] if committed else -1
            for s in steps:
                if s in keep or s > newest:
                    continue  # never the kept ones, nor a save that may still be in flight
                if self._key is not None and self._valid_unsigned(step_dir(s)):
                    continue  # not trusted under this key, but not ours to delete either
                self._loc.fs.rm(self._loc.path(step_dir(s)), recursive=True)
                log.debug("deleted checkpoint step %d", s)
        except Exception as exc:
            log.warning("checkpoint retention failed (will retry after the next save): %s", brief(exc))

    def is_committed(self, folder: str) -> bool:
        """Whether ``folder`` holds a valid manifest trusted under the key. Storage errors propagate:
        "cannot tell" must never read as "not committed" where that leads to deletion."""
        try:
            mf.read_manifest(self._loc, folder, self._key)
            return True
        except CheckpointCorrupt:
            return False

    def _valid_unsigned(self, folder: str) -> bool:
        """Whether ``folder`` holds a manifest that is valid except for its signature (written
        without this job's key: untrusted, and kept)."""
        try:
            mf.read_manifest(self._loc, folder)
            return True
        except CheckpointCorrupt:
            return False


__all__ = ["Committer"]
