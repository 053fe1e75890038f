"""The Hugging Face ``Trainer`` under ftrt: heartbeats, committed checkpoints, exact resume.

Five lines in a training script::

    from ftrt.integrations.hf import FtrtCallback, resume_checkpoint

    trainer = Trainer(model, args, train_dataset=data, callbacks=[FtrtCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))

- **Heartbeats**: every optimizer step reports ``global_step`` to the node's agent (hang
  detection, ``ftrt status``); a no-op outside ``ftrt launch``.
- **Commits**: the Trainer writes ``checkpoint-N/`` as usual (model, optimizer, scheduler, each
  rank's RNG state, its own state). Once every rank has written its part, rank 0 lists the folder's
  files with sizes and CRC-32s in ftrt's manifest (``manifest.json``, written last and atomically)
  and, under ``ftrt launch``, moves the job's ``latest`` pointer in etcd, fenced by the round, so a
  worker of a round that has ended can never make its folder the latest. A folder without a valid
  manifest does not exist for :func:`resume_checkpoint`.
- **Resume**: :func:`resume_checkpoint` returns the newest committed folder whose every file
  matches its manifest (and that is not newer than ``latest``), else None: what to pass to
  ``trainer.train(resume_from_checkpoint=...)``. The Trainer's own files are pickles
  (``torch.load``); they are read only after their checksums matched.

At the same world size the Trainer restores model, optimizer, scheduler, every rank's RNG and the
data position, so a run resumed after a worker crash logs bit-identical losses (tested). At another
world size the RNG files of the new ranks do not exist and its sampler reshards: see
docs/integrations.md.
"""

from __future__ import annotations

import logging
import time
import os
import re
from pathlib import Path

from transformers import TrainerCallback  # noqa: F401 - the integration needs transformers

import ftrt
from ftrt.checkpoint import manifest as mf
from ftrt.checkpoint.storage import MANIFEST, parse_url, write_bytes
from ftrt.errors import CheckpointCorrupt, RoundChanged

log = logging.getLogger("ftrt.integrations.hf")

_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _pointer(rt: ftrt.Runtime, output_dir: str):
    """The job's round-fenced ``latest`` pointer under ``ftrt launch``, else None."""
    from ftrt import envnames

    endpoints = os.environ.get(envnames.ETCD, "")
    if not rt.launched_by_ftrt or not endpoints:
        return None
    from ftrt.checkpoint.pointer import LatestPointer
    from ftrt.store.access import from_env

    return LatestPointer(endpoints, rt.job_id, rt.round, str(Path(output_dir).absolute()), access=from_env())


def commit_folder(output_dir: str, step: int, world_size: int, *, round_no: int = 0, pointer=None) -> int:
    """Write the manifest of ``output_dir/checkpoint-<step>`` (every file with size and CRC-32) and
    move ``pointer`` to it; return the bytes committed. A RoundChanged withdraws the manifest."""
    loc = parse_url(str(Path(output_dir).absolute()))
    folder = f"checkpoint-{step}"
    root = Path(loc.path(folder))
    files = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and rel != MANIFEST and ".tmp-" not in rel:
            files[rel] = mf.checksum_file(loc, str(f))
    manifest = mf.Manifest(step=step, world_size=world_size, files=files, round=round_no, time=time.time(),
                           extra={"trainer": "transformers"})
    path = loc.path(folder, MANIFEST)
    write_bytes(loc, path, manifest.to_json())
    if pointer is not None:
        try:
            pointer.commit(step)
        except RoundChanged:
            os.unlink(path)  # a stale round's checkpoint must not exist
            raise
    return sum(e.size for e in files.values())


def resume_checkpoint(output_dir: str) -> str | None:
    """The newest committed ``checkpoint-N`` folder of ``output_dir`` whose files all match their
    manifest (and, under ``ftrt launch``, that is not newer than the job's ``latest``), or None."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)) for p in root.iterdir() if (m := _FOLDER.match(p.name))), reverse=True)
    rt = ftrt.init()
    pointer = _pointer(rt, output_dir)
    latest = None
    if pointer is not None:
        try:
            latest = pointer.latest()
        finally:
            pointer.close()
    loc = parse_url(str(root.absolute()))
    for step in steps:
        folder = f"checkpoint-{step}"
        if latest is not None and step > latest:
            log.warning("not resuming from %s: newer than the job's latest committed checkpoint (%d)", folder, latest)
            continue
        try:
            mf.verify_step(loc, folder, name_of=lambda step: f"checkpoint-{step}")
        except CheckpointCorrupt as exc:
            log.warning("not resuming from %s: %s", folder, exc)
            continue
        return str(root / folder)
    return None


class FtrtCallback(TrainerCallback):
    """Heartbeats every step and a committed manifest for every checkpoint (module docstring)."""

    def __init__(self, runtime: ftrt.Runtime | None = None) -> None:
        self.rt = runtime or ftrt.init()
        self._pointers: dict[str, object] = {}  # rank 0: one etcd connection per output_dir, kept

    def _pointer_for(self, output_dir: str):
        if output_dir not in self._pointers:
            self._pointers[output_dir] = _pointer(self.rt, output_dir)
        return self._pointers[output_dir]

    def on_step_end(self, args, state, control, **kwargs):
        self.rt.heartbeat(state.global_step)
        return control

    def on_save(self, args, state, control, **kwargs):
        dist = _distributed()
        if dist is not None:
            dist.barrier()  # every rank has written its part of checkpoint-N
        if state.is_world_process_zero:
            commit_folder(args.output_dir, state.global_step, self.rt.world_size, round_no=self.rt.round,
                          pointer=self._pointer_for(args.output_dir))
        if dist is not None:
            dist.barrier()  # no rank goes on before the commit (or its failure) is settled
        return control

    def on_train_end(self, args, state, control, **kwargs):
        for pointer in self._pointers.values():
            if pointer is not None:
                pointer.close()
        self._pointers.clear()
        if state.global_step >= state.max_steps:
            self.rt.done()
        return control
