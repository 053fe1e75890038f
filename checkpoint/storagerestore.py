"""The storage restore: load a state from the newest checkpoint in storage that verifies.

Rank 0 lists the step folders (on a thread of its own, :class:`Listing`, so that a restore can try
the memory tier while a slow storage answers) and every rank learns the listing from it. Newest
first, a step is skipped with a warning naming why when it is newer than the job's pointer, has no
valid manifest (or, with a checkpoint key, none signed under it), or has a file whose size or sum
differs from the manifest's; the ranks verify disjoint shares of the files in parallel. The first
step that verifies is loaded in place with ``dcp.load``, which reshards DTensors to the current
world.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ftrt import _diag
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint import state as st
from ftrt.checkpoint.group import CheckpointGroup
from ftrt.checkpoint.signing import CheckpointKey
from ftrt.checkpoint.storage import Location, brief, dcp_reader, list_steps, step_dir
from ftrt.errors import CheckpointCorrupt, CheckpointUnavailable

log = logging.getLogger(__name__)


class Listing:
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


class StorageRestore:
    """Restores one checkpointer's state from its storage (see the module docstring).

    Args:
        group: the checkpointer's ranks.
        loc: where its checkpoints live.
        key: the job's checkpoint key; with one, only checkpoints signed under it are trusted.
    """

    def __init__(self, group: CheckpointGroup, loc: Location, key: CheckpointKey | None) -> None:
        self._group = group
        self._loc = loc
        self._key = key

    def listing(self) -> Listing | None:
        """Start listing storage's steps: on rank 0, which alone lists; None on the others."""
        return Listing(self._loc) if self._group.rank == 0 else None

    def listed(self, listing: Listing | None, timeout: float | None) -> tuple[list[int] | None, BaseException | None]:
        """Storage's steps as rank 0's ``listing`` found them (collective): (steps, None) or (None, the
        error); a listing still running after ``timeout`` seconds is a TimeoutError for now."""
        found = listing.wait(timeout) if listing is not None else None
        if listing is not None:
            _diag.mark("restore.listed")
        steps, error = self._group.broadcast(found)
        if error is not None:
            log.warning("cannot list the checkpoints in %s (%s)", self._loc.url, brief(error))
        return steps, error

    def restore(self, state: dict[str, Any], listing: Listing | None, limit: int | None) -> int | None:
        """Load the newest checkpoint in ``listing`` that verifies and is not above ``limit`` (the job's
        pointer, None for no limit) into ``state``; return its step. Collective.

        Returns None when storage holds no checkpoint; raises :class:`CheckpointUnavailable` when
        storage cannot be listed or fails while a verified checkpoint is read, and :class:`CheckpointCorrupt` when checkpoints exist but none
        verifies (the message lists why each was rejected).
        """
        import torch.distributed.checkpoint as dcp

        steps, storage_error = self.listed(listing, None)
        if storage_error is not None:
            raise CheckpointUnavailable(
                f"Cannot restore: listing the checkpoints in {self._loc.url} failed ({brief(storage_error)}) "
                f"and no memory checkpoint covers this job. Check that the storage is reachable; the "
                f"checkpoints there are untouched."
            ) from storage_error
        assert steps is not None
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
            try:
                dcp.load(target, storage_reader=dcp_reader(self._loc, folder), process_group=self._group.pg,
                         no_dist=not self._group.distributed)
            except (Exception, CheckpointException) as exc:  # DCP's, wrapping every rank's, is a BaseException
                raise CheckpointUnavailable(
                    f"Cannot restore: loading checkpoint step {step} from {self._loc.url} failed after it verified "
                    f"({brief(exc)}): the storage failed while it was read, or the checkpoint does not fit this "
                    f"state (another model or optimizer). The state may be half loaded, so this process must not "
                    f"train on; the checkpoint is untouched.") from exc
            st.apply(state, target)
            log.info("restored checkpoint step %d from %s", step, self._loc.url)
            return step
        if rejected:
            raise CheckpointCorrupt(
                f"No valid checkpoint under {self._loc.url}: " + "; ".join(rejected) + "."
            )
        return None

    def _verify(self, folder: str) -> str | None:
        """None if the checkpoint verifies on every rank, else the first reason found: the check of
        :func:`~ftrt.checkpoint.manifest.verify_step`, with the manifest read once (rank 0) and
        the files shared out over the ranks."""
        g = self._group
        found: Any
        if g.rank == 0:
            try:
                found = mf.read_manifest(self._loc, folder, self._key)
            except CheckpointCorrupt as exc:
                found = str(exc)
        else:
            found = None
        found = g.broadcast(found)
        if isinstance(found, str):
            return found
        names = sorted(found.files)
        share = names[g.rank::g.world]
        try:
            mf.verify_files(self._loc, folder, found, share)
            mine = None
        except CheckpointCorrupt as exc:
            mine = str(exc)
        except Exception as exc:
            mine = f"could not read files: {brief(exc)}"
        reasons = [r for r in g.all_gather(mine) if r]
        return reasons[0] if reasons else None


__all__ = ["Listing", "StorageRestore"]
