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

import re

from transformers import TrainerCallback  # noqa: F401 - the integration needs transformers

import ftrt
from ftrt.integrations.commits import barrier, commit_folder, job_pointer, newest_committed

_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def _folder(step: int) -> str:
    return f"checkpoint-{step}"


def resume_checkpoint(output_dir: str) -> str | None:
    """The newest committed ``checkpoint-N`` folder of ``output_dir`` whose files all match their
    manifest (and, under ``ftrt launch``, that is not newer than the job's ``latest``), or None."""
    return newest_committed(output_dir, _FOLDER, _folder)


class FtrtCallback(TrainerCallback):
    """Heartbeats every step and a committed manifest for every checkpoint (module docstring)."""

    def __init__(self, runtime: ftrt.Runtime | None = None) -> None:
        self.rt = runtime or ftrt.init()
        self._pointers: dict[str, object] = {}  # rank 0: one etcd connection per output_dir, kept

    def _pointer_for(self, output_dir: str):
        if output_dir not in self._pointers:
            self._pointers[output_dir] = job_pointer(self.rt, output_dir)
        return self._pointers[output_dir]

    def on_step_end(self, args, state, control, **kwargs):
        self.rt.heartbeat(state.global_step)
        return control

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has written its part of checkpoint-N
        if state.is_world_process_zero:
            commit_folder(args.output_dir, _folder(state.global_step), state.global_step, self.rt.world_size,
                          trainer="transformers", round_no=self.rt.round, pointer=self._pointer_for(args.output_dir))
        barrier()  # no rank goes on before the commit (or its failure) is settled
        return control

    def on_train_end(self, args, state, control, **kwargs):
        for pointer in self._pointers.values():
            if pointer is not None:
                pointer.close()
        self._pointers.clear()
        if state.global_step >= state.max_steps:
            self.rt.done()
        return control
