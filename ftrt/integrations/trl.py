"""TRL's ``GRPOTrainer`` under ftrt: the Hugging Face integration plus its generation buffer.

``GRPOTrainer`` generates completions once per *generation window* (``steps_per_generation x
num_iterations`` micro-steps) and trains the window's steps from a buffer (``_buffered_inputs``)
indexed by a micro-step counter (``_step``). Neither is in the Trainer's checkpoint, so a run
resumed inside a window regenerates at the wrong step and diverges without a warning (trl #3247;
PR #3148 made such a resume regenerate instead of failing, which keeps it running, not exact).
This callback adds both to every ``checkpoint-N/``, per rank, before ftrt commits the folder, and
puts them back when the Trainer resumes from it::

    from ftrt.integrations.trl import FtrtCallback, resume_checkpoint

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data)
    trainer.add_callback(FtrtCallback(trainer))
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer))

The data order is :class:`GenerationOrder`: TRL's ``RepeatSampler`` order (``generation_batch_size
/ num_generations`` prompts per generation, each ``num_generations`` times, the chunk repeated for
every micro-step of its window), drawn per ``(seed, epoch)``, whose position is counted in
generations, not in steps, so it survives a world-size change. Fix ``generation_batch_size`` in
the config: then every generation holds the same prompts at any world size (TRL derives
``steps_per_generation`` from it). The Trainer's own batch skipping is turned off; the callback
positions the order and restores the Trainer's RNG state where the skip would have.

After a world-size change the saved buffers belong to other ranks: :func:`resume_checkpoint` then
takes the newest committed checkpoint that lies on a window boundary (the steps of a half-trained
window are trained again; no prompt is skipped or trained twice) and the window starts with a
fresh generation. That is exact in prompts, not bit-exact (docs/integrations.md). So when ftrt asks
the round to end (a node joins or drains), the callback ends it at the end of the window in
progress, not at the next step, and tells the agent, which waits for those steps: the next round
redoes nothing (unless a drain's deadline cuts the wait).

The logged ``epoch`` is where the order stands, as a run never interrupted would log it (the
Trainer, made to skip nothing on resume, would count the resumed epoch from the resume).

Everything else (heartbeats, the manifest, the round-fenced ``latest`` pointer, resuming only a
committed and verified folder) is :mod:`ftrt.integrations.hf`'s. The buffer file holds tensors,
lists and numbers only and is read with ``torch.load(weights_only=True)``, after the folder's
checksums matched.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import torch
from trl import GRPOTrainer

from ftrt.data import ElasticSampler
from ftrt.errors import ConfigError
from ftrt.integrations import hf
from ftrt.integrations.commits import newest_committed

__all__ = ["FtrtCallback", "GenerationOrder", "resume_checkpoint"]

log = logging.getLogger("ftrt.integrations.trl")

FORMAT = 2


def _state_file(rank: int) -> str:
    return f"ftrt_grpo_rank{rank}.pt"


class GenerationOrder(torch.utils.data.Sampler[int]):
    """TRL's ``RepeatSampler`` order with a position in generations (module docstring).

    Generation ``g`` is chunk ``g % per_epoch`` of epoch ``g // per_epoch``'s permutation: ``prompts``
    prompt ids, each yielded ``repeats`` times, the whole chunk once per micro-step of its
    ``window``. Each pass yields from the position to the end of the position's epoch, then the
    position moves to the next epoch, so the Trainer's epochs continue where the last one ended.
    """

    def __init__(self, size: int, prompts: int, repeats: int, window: int, *, seed: int, shuffle: bool = True,
                 start: tuple[int, int] = (0, 0)) -> None:
        self.order = ElasticSampler(size, prompts, seed=seed, shuffle=shuffle)
        self.prompts, self.repeats, self.window = prompts, repeats, window
        self.per_epoch = size // prompts
        self.generation, self.offset = start

    def chunk(self, generation: int) -> list[int]:
        """The prompt ids of generation ``generation``."""
        epoch, c = divmod(generation, self.per_epoch)
        return self.order.ledger(epoch, c * self.prompts)

    def __iter__(self) -> Iterator[int]:
        epoch = self.generation // self.per_epoch
        first, offset = self.generation, self.offset
        self.generation, self.offset = (epoch + 1) * self.per_epoch, 0
        for g in range(first, (epoch + 1) * self.per_epoch):
            ids = self.chunk(g)
            for _ in range(offset if g == first else 0, self.window):
                for i in ids:
                    yield from (i,) * self.repeats

    def __len__(self) -> int:
        return self.per_epoch * self.window * self.prompts * self.repeats


class FtrtCallback(hf.FtrtCallback):
    """:class:`ftrt.integrations.hf.FtrtCallback` that also checkpoints ``trainer``'s generation
    buffer and micro-step counter and positions its data (module docstring)."""

    def __init__(self, trainer: GRPOTrainer, runtime=None) -> None:
        super().__init__(runtime)
        if not hasattr(trainer, "_buffered_inputs") or not hasattr(trainer, "_step"):
            raise ConfigError(f"ftrt.integrations.trl.FtrtCallback needs a GRPOTrainer (with _buffered_inputs and "
                              f"_step); got {type(trainer).__name__}. Use ftrt.integrations.hf.FtrtCallback instead.")
        if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
            raise ConfigError("ftrt.integrations.trl needs a map-style train_dataset (indexable): an iterable "
                              "dataset has no position ftrt could restore at another world size.")
        self.trainer = trainer
        self.window = trainer.args.steps_per_generation * trainer.num_iterations
        self._per_epoch = 0  # generations in an epoch, known once the Trainer asked for its sampler
        self._start: tuple[int, int] = (0, 0)  # (generation, micro-step in its window) at _step == _start_step
        self._start_step = 0
        self._resumed: tuple[str, dict | None] | None = None  # (folder, this rank's saved state) until applied
        self._rng_folder: str | None = None  # reload the Trainer's RNG state here at the first step
        trainer.args.ignore_data_skip = True  # the order is positioned here, in generations
        trainer._get_train_sampler = self._sampler

    def _sampler(self, dataset=None) -> GenerationOrder:
        args = self.trainer.args
        dataset = dataset if dataset is not None else self.trainer.train_dataset
        order = GenerationOrder(len(dataset), args.generation_batch_size // self.trainer.num_generations,
                                self.trainer.num_generations, self.window, seed=args.seed,
                                shuffle=self.trainer.shuffle_dataset, start=self._start)
        self._per_epoch = order.per_epoch
        return order

    def _rank_world(self) -> tuple[int, int]:
        return self.trainer.accelerator.process_index, self.trainer.accelerator.num_processes

    def position(self) -> tuple[int, int]:
        """(generation, micro-step in its window) of the next micro-step."""
        micro = self._start[0] * self.window + self._start[1] + self.trainer._step - self._start_step
        return divmod(micro, self.window)

    def round_end_step(self, state) -> int:
        """The end of the generation window in progress: a round of another world size can resume
        only from a window boundary (inside a window the buffers are the old ranks'), so ending
        the round there redoes nothing. The step just trained when it ends a window, or when the
        window's end is not an optimizer step (``gradient_accumulation_steps`` does not divide
        what is left of it)."""
        offset = self.position()[1]
        left, accumulation = self.window - offset, self.trainer.args.gradient_accumulation_steps
        if offset == 0 or left % accumulation:
            return state.global_step
        return state.global_step + left // accumulation

    def on_step_end(self, args, state, control, **kwargs):
        # With ignore_data_skip the Trainer counts a resumed epoch's micro-steps from the resume, so
        # the epoch it logs would start again near 0: it is where the order stands, computed as the
        # Trainer computes it in a run that was never interrupted (micro-steps of the epoch done over
        # micro-steps in an epoch), so the two log the same number.
        if self._per_epoch:
            generation, offset = self.position()
            per_epoch = self._per_epoch * self.window
            epoch, done = divmod(generation * self.window + offset, per_epoch)
            state.epoch = epoch + done / per_epoch
        return super().on_step_end(args, state, control, **kwargs)

    # -- saving ------------------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        rank, world = self._rank_world()
        folder = os.path.join(args.output_dir, hf._folder(state.global_step))
        generation, offset = self.position()
        payload = {"format": FORMAT, "global_step": state.global_step, "world_size": world,
                   "micro_step": self.trainer._step, "generation": generation, "offset": offset,
                   "buffered": self.trainer._buffered_inputs}
        path = os.path.join(folder, _state_file(rank))
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(payload, tmp)
        os.replace(tmp, path)  # before the commit below lists the folder's files
        return super().on_save(args, state, control, **kwargs)

    # -- resuming ----------------------------------------------------------------------------------
    def _load(self, folder: str, rank: int) -> dict[str, Any]:
        path = os.path.join(folder, _state_file(rank))
        device = self.trainer.accelerator.device
        saved = torch.load(path, weights_only=True, map_location="cpu" if device.type == "cpu" else device)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ConfigError(f"{path} is not GRPO state of format {FORMAT} (found "
                              f"{saved.get('format') if isinstance(saved, dict) else type(saved).__name__!r}): "
                              "resume from a checkpoint written by this version of ftrt.")
        return saved

    def _acceptable(self, folder: str) -> str | None:
        if not os.path.exists(os.path.join(folder, _state_file(0))):
            return "it has no GRPO state (not saved through ftrt.integrations.trl)"
        saved = self._load(folder, 0)
        if saved["world_size"] != self._rank_world()[1] and saved["offset"] != 0:
            return (f"it lies inside a generation window and was saved by {saved['world_size']} ranks, whose "
                    f"buffers do not fit {self._rank_world()[1]}")
        return None

    def resume_checkpoint(self) -> str | None:
        """The newest committed checkpoint this trainer can resume from exactly in prompts (module
        docstring), with the data order positioned for it; or None."""
        folder = newest_committed(self.trainer.args.output_dir, hf._FOLDER, hf._folder, self._acceptable)
        if folder is None:
            return None
        rank, world = self._rank_world()
        head = self._load(folder, 0)
        same_world = head["world_size"] == world
        mine = self._load(folder, rank) if same_world else None
        self._start = (head["generation"], head["offset"])
        self._start_step = mine["micro_step"] if mine is not None else 0
        self._resumed = (folder, mine)
        if not same_world:
            log.warning("%s was saved by %d ranks, this run has %d: the run goes on from generation %d with a "
                        "fresh generation; no prompt is skipped or repeated, but it is not bit-exact",
                        folder, head["world_size"], world, head["generation"])
        return folder

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0 and self._resumed is None:
            raise ConfigError("The GRPOTrainer resumed from a checkpoint that ftrt did not position: pass "
                              "resume_from_checkpoint=ftrt.integrations.trl.resume_checkpoint(trainer).")
        if self._resumed is not None:
            folder, mine = self._resumed
            self._resumed = None
            self.trainer._step = self._start_step
            self.trainer._buffered_inputs = mine["buffered"] if mine is not None else None
            self._rng_folder = folder if mine is not None else None
            log.info("resumed GRPO at generation %d, micro-step %d of its window, from %s", *self._start, folder)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if self._rng_folder is not None:
            # where the Trainer's own batch skipping would have restored it: after the first fetch
            self.trainer._load_rng_state(self._rng_folder)
            self._rng_folder = None
        return control


def resume_checkpoint(trainer: GRPOTrainer) -> str | None:
    """What to pass to ``trainer.train(resume_from_checkpoint=...)``: see
    :meth:`FtrtCallback.resume_checkpoint` (the callback must have been added to ``trainer``)."""
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, FtrtCallback) and cb.trainer is trainer:
            return cb.resume_checkpoint()
    raise ConfigError("resume_checkpoint(trainer) needs ftrt's callback on that trainer: "
                      "trainer.add_callback(ftrt.integrations.trl.FtrtCallback(trainer)) first.")
