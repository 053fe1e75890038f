"""DCP storage classes with ftrt's commit: for code that calls ``dcp.save``/``dcp.load`` itself.

A training loop written against ``torch.distributed.checkpoint`` (torchtitan-style) keeps its
calls and swaps the storage::

    from ftrt.checkpoint.dcp import FtrtStorageReader, FtrtStorageWriter

    dcp.save(state, storage_writer=FtrtStorageWriter(url, step))
    reader = FtrtStorageReader(url)          # the newest committed, verified step, or
    if reader.step is not None:              # None when there is none yet
        dcp.load(state, storage_reader=reader)

The writer stores step ``step`` in ftrt's layout (``<url>/step-<N>/``, local paths, file://, s3://
or memory://) through DCP's own file writer; when DCP finishes the save, the coordinator sums
every file of the folder (CRC-32; SHA-256 and a signed manifest with the job's checkpoint key) and
writes ``manifest.json`` last. Under ``ftrt launch`` it first checks that its round is still the
job's and then moves the job's ``latest`` pointer in etcd, fenced by that round; a round that has
moved on gets no checkpoint (the manifest is withdrawn) and the save raises on every rank.

The reader picks the newest step whose manifest is valid, whose every file matches it and which is
not newer than ``latest``: a folder killed between its data and its commit, or changed since, is
passed over with a warning. DCP's ``.metadata`` is a pickle and its non-tensor values are
``torch.save``d: nothing is read before its checksum matched. Each rank verifies the folder's files
itself (a read of the whole checkpoint per rank; :class:`ftrt.checkpoint.Checkpointer` shares that
work out over the ranks and adds the memory tier).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch.distributed.checkpoint import StorageReader, StorageWriter

from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.commit import CommitFence, commit_folder, newest_verified
from ftrt.checkpoint.pointer import job_pointer
from ftrt.checkpoint.signing import CheckpointKey, load_key
from ftrt.checkpoint.storage import Location, dcp_reader, dcp_writer, list_steps, parse_url, step_dir
from ftrt.errors import CheckpointCorrupt, ConfigError

log = logging.getLogger(__name__)

_UNSET: Any = object()
def _same_target(checkpoint_id: str | os.PathLike | None, loc: Location, folder: str) -> None:
    if checkpoint_id is not None and str(checkpoint_id).rstrip("/") not in (loc.path(folder), loc.url_of(folder)):
        raise ConfigError(f"checkpoint_id = {str(checkpoint_id)!r} does not name this storage's folder "
                          f"{loc.url_of(folder)!r}: leave checkpoint_id out when passing ftrt's storage classes.")


class FtrtStorageWriter(StorageWriter):
    """DCP's writer for ``url``'s step ``step``, committed by ftrt (module docstring).

    Args:
        url: the checkpoint root (path, file://, s3://, memory://).
        step: the step this save is.
        storage_options: fsspec options (e.g. an S3 endpoint).
        key: the job's checkpoint key (default: the launcher's, or ``$FTRT_CHECKPOINT_KEY``).
        fence: what fences the commit to the job's round (:class:`~ftrt.checkpoint.commit.CommitFence`;
            default: the job's ``latest`` pointer under ``ftrt launch``, else none).
        thread_count: DCP's writer threads per rank.
    """

    def __init__(self, url: str, step: int, *, storage_options: dict | None = None,
                 key: CheckpointKey | None = _UNSET, fence: CommitFence | None = _UNSET,
                 thread_count: int = 2) -> None:
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"FtrtStorageWriter step = {step!r}: give the training step, a whole number >= 0.")
        self.loc = parse_url(url, storage_options)
        self.step = step
        self.folder = step_dir(step)
        self.url = url
        self.key = load_key() if key is _UNSET else key
        self._fence = fence  # _UNSET: the job's pointer, made on the coordinator when it commits
        self._inner = dcp_writer(self.loc, self.folder, thread_count)
        self.committed_bytes: int | None = None
        """Bytes committed by the last save (on the coordinator), else None."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        _same_target(checkpoint_id, self.loc, self.folder)
        self._inner.reset(None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan):
        return self._inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        return self._inner.prepare_global_plan(plans)

    def write_data(self, plan, planner):
        return self._inner.write_data(plan, planner)

    def storage_meta(self):
        return self._inner.storage_meta()

    def finish(self, metadata, results) -> None:
        """DCP's finish (``.metadata``), then ftrt's commit (module docstring); coordinator only."""
        self._inner.finish(metadata, results)
        fence = job_pointer(self.url) if self._fence is _UNSET else self._fence
        manifest = commit_folder(self.loc, self.folder, self.step, len(results), fence=fence, key=self.key,
                                 extra={"writer": "ftrt.checkpoint.dcp"})
        self.committed_bytes = manifest.total_bytes
        log.info("committed step %d at %s (%d files, %d bytes)", self.step, self.loc.url_of(self.folder),
                 len(manifest.files), self.committed_bytes)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # chosen by passing an instance, never by DCP from an id


class FtrtStorageReader(StorageReader):
    """DCP's reader for ``url``'s newest committed, verified step, or ``step`` (module docstring).

    ``step`` is None when the root holds no usable checkpoint; loading then raises.

    Args:
        url: the checkpoint root.
        step: the step to read (verified like any other), or None for the newest usable one.
        storage_options: fsspec options.
        key: the job's checkpoint key (default: the launcher's, or ``$FTRT_CHECKPOINT_KEY``).
        latest: the newest step the job trusts (default: the job's pointer under ``ftrt launch``).
    """

    def __init__(self, url: str, step: int | None = None, *, storage_options: dict | None = None,
                 key: CheckpointKey | None = _UNSET, latest: int | None = _UNSET) -> None:
        self.loc = parse_url(url, storage_options)
        self.key = load_key() if key is _UNSET else key
        if latest is _UNSET:
            pointer = job_pointer(url)
            latest = pointer.latest() if pointer is not None else None
        self.step = (newest_verified(self.loc, list_steps(self.loc), step_dir, latest=latest, key=self.key)
                     if step is None else self._verified(step))
        self._inner = dcp_reader(self.loc, step_dir(self.step)) if self.step is not None else None

    def _verified(self, step: int) -> int:
        mf.verify_step(self.loc, step_dir(step), self.key)
        return step

    def _reader(self):
        if self._inner is None:
            raise CheckpointCorrupt(f"{self.loc.url_of('')} holds no committed checkpoint that verifies: there is "
                                    "nothing to load (check FtrtStorageReader.step before dcp.load).")
        return self._inner

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        reader = self._reader()
        _same_target(checkpoint_id, self.loc, step_dir(self.step))
        reader.reset(None)

    def read_metadata(self, *args: Any, **kwargs: Any):
        return self._reader().read_metadata(*args, **kwargs)  # verified with every file in __init__

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._reader().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan):
        return self._reader().prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        return self._reader().prepare_global_plan(plans)

    def read_data(self, plan, planner):
        return self._reader().read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False
