"""Committed checkpoint folders for trainers that write their own files (no trainer library here).

A trainer (the Hugging Face ``Trainer``, Lightning, TRL) writes one folder per checkpoint in its own
format. ftrt makes that folder *committed*: once every rank has written its part, rank 0 lists the
folder's files with sizes and CRC-32s in ftrt's manifest (``manifest.json``, written last and
atomically) and, under ``ftrt launch``, moves the job's ``latest`` pointer in etcd, fenced by the
round, so a worker of a round that has ended can never make its folder the latest (its manifest is
withdrawn), but for the step a planned change (a join, a drain) ends its round at, committed before
the next round's workers start (:class:`ftrt.checkpoint.pointer.LatestPointer`). :func:`newest_committed` is the reading side: the newest folder whose every file matches
its manifest and that is not newer than ``latest``. Trainers' files are often pickles
(``torch.load``): they must be read only after that check.
"""

from __future__ import annotations

import atexit
import re
from pathlib import Path
from typing import Callable

from ftrt.checkpoint.commit import commit_folder as commit
from ftrt.checkpoint.commit import newest_verified
from ftrt.checkpoint.pointer import LatestPointer
from ftrt.checkpoint.pointer import job_pointer as pointer_for
from ftrt.checkpoint.storage import parse_url
from ftrt.roundend import distributed


def barrier() -> None:
    """A barrier over the default group (nothing without one)."""
    dist = distributed()
    if dist is not None:
        dist.barrier()


_DESTROY_REGISTERED = False


def destroy_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits normally, while it is still
    whole (once per process; a no-op when the script destroyed it itself).

    The Trainer and Accelerate leave it up. A gloo group still alive at interpreter finalization can
    abort the process in its teardown ("terminate called without an active exception", SIGABRT;
    pytorch #190489): under ``ftrt launch`` that exit counts as a worker failure even after
    :meth:`ftrt.Runtime.done`, and the job restarts from its final checkpoint (seen once in a TRL
    run)."""
    global _DESTROY_REGISTERED
    if _DESTROY_REGISTERED:
        return
    _DESTROY_REGISTERED = True

    def destroy() -> None:
        dist = distributed()
        if dist is not None:
            dist.destroy_process_group()

    atexit.register(destroy)


def job_pointer(output_dir: str) -> LatestPointer | None:
    """The job's round-fenced ``latest`` pointer for ``output_dir`` under ``ftrt launch``, else None
    (on the worker's shared etcd connection: a pointer costs nothing to make)."""
    return pointer_for(str(Path(output_dir).absolute()))


def commit_folder(output_dir: str, folder: str, step: int, world_size: int, *, trainer: str,
                  extra: dict | None = None) -> int:
    """Commit ``output_dir/folder`` as ``step`` (:func:`ftrt.checkpoint.commit.commit_folder`: the
    manifest of every file, fenced by the job's pointer under ``ftrt launch``); return the bytes
    committed."""
    loc = parse_url(str(Path(output_dir).absolute()))
    manifest = commit(loc, folder, step, world_size, fence=job_pointer(output_dir),
                      extra={"trainer": trainer, **(extra or {})})
    return manifest.total_bytes


def newest_committed(output_dir: str, pattern: re.Pattern, name_of: Callable[[int], str],
                     accept: Callable[[str], str | None] | None = None) -> str | None:
    """The newest folder of ``output_dir`` named by ``pattern`` (its group 1 the step) whose files
    all match their manifest and, under ``ftrt launch``, whose step is not newer than the job's
    ``latest``; or None. ``name_of(step)`` must give the folder's name back. ``accept(path)``, called
    only on a verified folder, may pass it over by returning the reason."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir() if (m := pattern.match(p.name))]
    pointer = job_pointer(output_dir)
    latest = pointer.latest() if pointer is not None else None
    step = newest_verified(parse_url(str(root.absolute())), steps, name_of, latest=latest,
                           accept=(lambda folder: accept(str(root / folder))) if accept is not None else None)
    return None if step is None else str(root / name_of(step))
