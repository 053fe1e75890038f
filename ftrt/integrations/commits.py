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

import logging
import os
import re
import time
from pathlib import Path
from typing import Callable

import ftrt
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.pointer import LatestPointer
from ftrt.checkpoint.storage import MANIFEST, parse_url, write_bytes
from ftrt.errors import CheckpointCorrupt, RoundChanged

log = logging.getLogger("ftrt.integrations")


def distributed():
    """``torch.distributed`` when a default process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def barrier() -> None:
    """A barrier over the default group (nothing without one)."""
    dist = distributed()
    if dist is not None:
        dist.barrier()


def round_ends(rt: ftrt.Runtime) -> bool:
    """Whether every rank agrees to end the round after this step, because ftrt asked (a node joins
    or drains): :meth:`ftrt.Runtime.round_ending` seen on any rank, max-reduced over the default
    group (each rank sees the request at its own moment). One tiny all-reduce per call; call it
    once per optimizer step on every rank. Always False outside ``ftrt launch``."""
    if not rt.launched_by_ftrt:
        return False
    mine = rt.round_ending()
    dist = distributed()
    if dist is None:
        return mine
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def job_pointer(rt: ftrt.Runtime, output_dir: str) -> LatestPointer | None:
    """The job's round-fenced ``latest`` pointer under ``ftrt launch``, else None."""
    from ftrt import envnames
    from ftrt.store.access import from_env

    endpoints = os.environ.get(envnames.ETCD, "")
    if not rt.launched_by_ftrt or not endpoints:
        return None
    return LatestPointer(endpoints, rt.job_id, rt.round, str(Path(output_dir).absolute()), access=from_env())


def commit_folder(output_dir: str, folder: str, step: int, world_size: int, *, trainer: str, round_no: int = 0,
                  pointer: LatestPointer | None = None, extra: dict | None = None) -> int:
    """Write the manifest of ``output_dir/folder`` (every file with size and CRC-32) and move
    ``pointer`` to ``step``; return the bytes committed. A RoundChanged withdraws the manifest."""
    loc = parse_url(str(Path(output_dir).absolute()))
    root = Path(loc.path(folder))
    files = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and rel != MANIFEST and ".tmp-" not in rel:
            files[rel] = mf.checksum_file(loc, str(f))
    manifest = mf.Manifest(step=step, world_size=world_size, files=files, round=round_no, time=time.time(),
                           extra={"trainer": trainer, **(extra or {})})
    path = loc.path(folder, MANIFEST)
    write_bytes(loc, path, manifest.to_json())
    if pointer is not None:
        try:
            pointer.commit(step)
        except RoundChanged:
            os.unlink(path)  # a stale round's checkpoint must not exist
            raise
    return sum(e.size for e in files.values())


def newest_committed(output_dir: str, pattern: re.Pattern, name_of: Callable[[int], str],
                     runtime: ftrt.Runtime | None = None, accept: Callable[[str], str | None] | None = None
                     ) -> str | None:
    """The newest folder of ``output_dir`` named by ``pattern`` (its group 1 the step) whose files
    all match their manifest and, under ``ftrt launch``, whose step is not newer than the job's
    ``latest``; or None. ``name_of(step)`` must give the folder's name back. ``accept(path)``, called
    only on a verified folder, may pass it over by returning the reason."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)) for p in root.iterdir() if (m := pattern.match(p.name))), reverse=True)
    pointer = job_pointer(runtime or ftrt.init(), output_dir)
    latest = None
    if pointer is not None:
        try:
            latest = pointer.latest()
        finally:
            pointer.close()
    loc = parse_url(str(root.absolute()))
    for step in steps:
        folder = name_of(step)
        if latest is not None and step > latest:
            log.warning("not resuming from %s: newer than the job's latest committed checkpoint (%d)", folder, latest)
            continue
        try:
            mf.verify_step(loc, folder, name_of=name_of)
        except CheckpointCorrupt as exc:
            log.warning("not resuming from %s: %s", folder, exc)
            continue
        reason = accept(str(root / folder)) if accept is not None else None
        if reason is not None:
            log.warning("not resuming from %s: %s", folder, reason)
            continue
        return str(root / folder)
    return None
