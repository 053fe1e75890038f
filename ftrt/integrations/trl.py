"""TRL's ``GRPOTrainer`` under ftrt: the Hugging Face integration plus its generation buffer.

``GRPOTrainer`` generates completions once per *generation window* (``steps_per_generation x
num_iterations`` micro-steps) and trains the window's steps from a buffer (``_buffered_inputs``)
indexed by a micro-step counter (``_step``). Neither is in the Trainer's checkpoint, so a run
resumed inside a window regenerates at the wrong step and diverges without a warning (trl #3247;
PR #3148 was not merged). This callback adds both to every ``checkpoint-N/``, per rank, before
ftrt commits the folder, and puts them back when the Trainer resumes from it::

    from ftrt.integrations.trl import FtrtCallback, resume_checkpoint

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data)
    trainer.add_callback(FtrtCallback(trainer))
    trainer.train(resume_from_checkpoint=resume_checkpoint(config.output_dir))

Everything else (heartbeats, the manifest, the round-fenced ``latest`` pointer, resuming only a
committed and verified folder) is :mod:`ftrt.integrations.hf`'s. The buffer file holds tensors,
lists and numbers only and is read with ``torch.load(weights_only=True)``, after the folder's
checksums matched. At another world size the buffers do not fit the new ranks: the callback drops
them and the window starts again with a fresh generation (not exact; docs/integrations.md).
"""

from __future__ import annotations

import logging
import os

import torch
from trl import GRPOTrainer

from ftrt.integrations import hf
from ftrt.integrations.hf import resume_checkpoint

__all__ = ["FtrtCallback", "resume_checkpoint"]

log = logging.getLogger("ftrt.integrations.trl")

FORMAT = 1


def _state_file(rank: int) -> str:
    return f"ftrt_grpo_rank{rank}.pt"


class FtrtCallback(hf.FtrtCallback):
    """:class:`ftrt.integrations.hf.FtrtCallback` that also checkpoints ``trainer``'s generation
    buffer and micro-step counter (module docstring)."""

    def __init__(self, trainer: GRPOTrainer, runtime=None) -> None:
        super().__init__(runtime)
        if not hasattr(trainer, "_buffered_inputs") or not hasattr(trainer, "_step"):
            raise TypeError(f"ftrt.integrations.trl.FtrtCallback needs a GRPOTrainer (with _buffered_inputs and "
                            f"_step); got {type(trainer).__name__}. Use ftrt.integrations.hf.FtrtCallback instead.")
        self.trainer = trainer

    def _rank_world(self) -> tuple[int, int]:
        return self.trainer.accelerator.process_index, self.trainer.accelerator.num_processes

    def on_save(self, args, state, control, **kwargs):
        rank, world = self._rank_world()
        folder = os.path.join(args.output_dir, hf._folder(state.global_step))
        payload = {"format": FORMAT, "global_step": state.global_step, "world_size": world,
                   "micro_step": self.trainer._step, "buffered": self.trainer._buffered_inputs}
        path = os.path.join(folder, _state_file(rank))
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(payload, tmp)
        os.replace(tmp, path)  # before the commit below lists the folder's files
        return super().on_save(args, state, control, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:
            self._restore(os.path.join(args.output_dir, hf._folder(state.global_step)), state.global_step,
                          args.gradient_accumulation_steps)
        return control

    def _restore(self, folder: str, global_step: int, accumulation: int) -> None:
        rank, world = self._rank_world()
        path = os.path.join(folder, _state_file(rank))
        fallback = global_step * accumulation  # the micro-steps of a run that never changed accumulation
        if not os.path.exists(path):
            log.warning("%s has no GRPO buffer for rank %d: the resumed run generates afresh at step %d, which is "
                        "not what the uninterrupted run did (not exact)", folder, rank, global_step + 1)
            self.trainer._step, self.trainer._buffered_inputs = fallback, None
            return
        device = self.trainer.accelerator.device
        saved = torch.load(path, weights_only=True, map_location="cpu" if device.type == "cpu" else device)
        if saved.get("format") != FORMAT or saved.get("global_step") != global_step:
            raise ValueError(f"{path} holds GRPO state of format {saved.get('format')!r} at step "
                             f"{saved.get('global_step')!r}, not format {FORMAT} at step {global_step}: resume from "
                             "the folder the Trainer resumes from, written by this version of ftrt.")
        if saved["world_size"] != world:
            log.warning("%s was saved by %d ranks, this run has %d: its generation buffers are dropped and the "
                        "window starts with a fresh generation (not exact)", folder, saved["world_size"], world)
            self.trainer._step, self.trainer._buffered_inputs = fallback, None
            return
        self.trainer._step, self.trainer._buffered_inputs = saved["micro_step"], saved["buffered"]
        log.info("restored rank %d's GRPO buffer (micro-step %d) from %s", rank, saved["micro_step"], folder)
