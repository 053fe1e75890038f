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
  worker of a round that has ended can never make its folder the latest (but for the step a
  planned change ends its round at, below). A folder without a valid
  manifest does not exist for :func:`resume_checkpoint`.
- **Round ends**: when ftrt asks to end the round at a step boundary (a node joins or drains),
  the ranks agree on it (one tiny all-reduce a step), the Trainer saves that step, ftrt commits
  it (a planned change lets the ending round still commit) and the workers exit: the next round
  resumes from that step with nothing redone. (TRL's callback ends it at the end of the
  generation window instead: :mod:`ftrt.integrations.trl`.)
- **Resume**: :func:`resume_checkpoint` returns the newest committed folder whose every file
  matches its manifest (and that is not newer than ``latest``), else None: what to pass to
  ``trainer.train(resume_from_checkpoint=...)``. The Trainer's own files are pickles
  (``torch.load``); they are read only after their checksums matched.
- **The end of a job**: a run resumed from its final checkpoint (a worker killed after the last
  commit, or the job launched again in the same folder) trains nothing and says the job is
  finished; the Trainer alone would train one step past ``max_steps``.

At the same world size the Trainer restores model, optimizer, scheduler, every rank's RNG and the
data position, so a run resumed after a worker crash logs bit-identical losses (tested). At another
world size the RNG files of the new ranks do not exist and its sampler reshards: see
docs/integrations.md.

**Node loss without skips**: :class:`ElasticTrainer` (or the :class:`ElasticData` mixin on any
``Trainer`` subclass) trains the data in the order of :class:`ftrt.data.ElasticSampler`, whose
state, the global trained frontier, is saved in every checkpoint and restored at any world size::

    trainer = ElasticTrainer(model, args, train_dataset=data, global_batch=64, callbacks=[FtrtCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))

Each optimizer step trains one global batch of ``global_batch`` samples, split over the ranks as
``ElasticSampler`` splits it and each rank's share cut into ``gradient_accumulation_steps``
micro-batches (``per_device_train_batch_size`` is not used). After a world-size change the data
go on at the next global batch, nothing skipped or repeated; the run is then not bit-identical
(the RNG of the new ranks, the reductions): a warning says so.
"""

from __future__ import annotations

import json
import logging
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback  # the integration needs transformers
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, has_length, seed_worker
from transformers.utils import is_datasets_available

import ftrt
from ftrt.checkpoint.storage import parse_url, write_bytes
from ftrt.data import ElasticSampler
from ftrt.errors import CheckpointCorrupt, ConfigError, FtrtError
from ftrt.integrations.commits import barrier, commit_folder, destroy_group_at_exit, newest_committed
from ftrt.roundend import RoundEndVote

log = logging.getLogger(__name__)

_FOLDER = re.compile(r"^checkpoint-(\d+)$")

SAMPLER_FILE = "ftrt_sampler.json"
"""The data position inside every ``checkpoint-N/`` an :class:`ElasticTrainer` writes (rank 0)."""


def _folder(step: int) -> str:
    return f"checkpoint-{step}"


def resume_checkpoint(output_dir: str) -> str | None:
    """The newest committed ``checkpoint-N`` folder of ``output_dir`` whose files all match their
    manifest (and, under ``ftrt launch``, that is not newer than the job's ``latest``), or None."""
    return newest_committed(output_dir, _FOLDER, _folder)


_FINISHED_GUARD = "_ftrt_stops_at_max_steps"
"""Set on the ``Trainer._run_epoch`` that :func:`_stop_at_max_steps` installs."""


def _stop_at_max_steps() -> None:
    """Make every ``Trainer`` of this process train nothing when it resumes at or past ``max_steps``.

    transformers (5.24, 5.25) does not check ``global_step`` against ``max_steps`` before an
    epoch's first step, only after each step: a run resumed from its final checkpoint (a worker
    killed after the last commit and restarted by ftrt, or a finished job launched again in the
    same ``output_dir``) trains one step past its end and saves ``checkpoint-<max_steps + 1>``,
    unless ``max_steps`` ends an epoch. Wrap ``Trainer._run_epoch`` (once per process) so that it
    trains nothing then and stops the training; ``train()`` still returns normally, with the
    resumed model loaded, so a script's own code after it (``save_model``, a push) runs as it
    would have. Only that case changes."""
    run_epoch = getattr(Trainer, "_run_epoch", None)
    if run_epoch is None:
        import transformers

        log.warning("transformers %s has no Trainer._run_epoch: ftrt cannot stop a run resumed from its final "
                    "checkpoint from training one step past max_steps (install transformers 5.24 or newer).",
                    transformers.__version__)
        return
    if getattr(run_epoch, _FINISHED_GUARD, False):
        return

    def run_epoch_unless_finished(self, *args, **kwargs):
        state = self.state
        if 0 < state.max_steps <= state.global_step:
            self.control.should_training_stop = True
            if not getattr(self, "_ftrt_said_finished", False):
                self._ftrt_said_finished = True
                log.warning("Training is already finished: the run resumed at step %d of max_steps %d, so no step "
                            "is trained (the job was restarted or launched again after its final checkpoint).",
                            state.global_step, state.max_steps)
            return None
        return run_epoch(self, *args, **kwargs)

    setattr(run_epoch_unless_finished, _FINISHED_GUARD, True)
    Trainer._run_epoch = run_epoch_unless_finished


class FtrtCallback(TrainerCallback):
    """Heartbeats every step and a committed manifest for every checkpoint (module docstring).

    Constructing it also guards every ``Trainer`` of the process against training past
    ``max_steps`` when it resumes from its final checkpoint (:func:`_stop_at_max_steps`). Once
    training ended, the process group is destroyed at exit
    (:func:`~ftrt.integrations.commits.destroy_group_at_exit`)."""

    def __init__(self, runtime: ftrt.Runtime | None = None) -> None:
        _stop_at_max_steps()
        self.rt = runtime or ftrt.init()
        self._end_after: int | None = None  # the step the round ends after (a node joins or drains)
        self._ending = False  # the round ends after this step's save
        self._round_ends = RoundEndVote(self.rt)

    def round_end_step(self, state) -> int:
        """The step after which a round asked to end (a node joins or drains) ends: the one just
        trained. A subclass whose checkpoints are of use to the next round only at coarser
        boundaries returns the next of those (the agent is told and waits)."""
        return state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.rt.heartbeat(state.global_step)
        if self._end_after is None and state.global_step < state.max_steps and self._round_ends():
            # A planned change: the ranks agreed on it after this step, so they all choose the same end.
            self._end_after = self.round_end_step(state)
            if self._end_after > state.global_step:
                self.rt.round_ends_after(self._end_after)
                log.info("the round ends after step %d (asked at step %d): the next boundary a new round can "
                         "resume from without redoing steps", self._end_after, state.global_step)
        if state.global_step == self._end_after and state.global_step < state.max_steps:
            # Save this step (committed, though the next round is written) and leave; the next
            # round resumes from it with nothing redone.
            self._ending = True
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has written its part of checkpoint-N
        if state.is_world_process_zero:
            commit_folder(args.output_dir, _folder(state.global_step), state.global_step, self.rt.world_size,
                          trainer="transformers")
        barrier()  # no rank goes on before the commit (or its failure) is settled
        if self._ending:
            self.rt.exit_for_round()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._round_ends.close()
        if state.global_step >= state.max_steps:
            self.rt.done()
        destroy_group_at_exit()  # after training ended well: nothing of it is in flight any more
        return control


# -- ElasticSampler as the Trainer's data order ---------------------------------------------------------
def _read_sampler_state(checkpoint: str) -> dict[str, Any]:
    path = Path(checkpoint) / SAMPLER_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{checkpoint} has no {SAMPLER_FILE}: it was not written by an ElasticTrainer, so its data "
                          "position is unknown. Resume it with the Trainer that wrote it, or start in a new "
                          "output_dir.") from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path} cannot be read as JSON: {exc}.") from exc
    if not isinstance(state, dict) or not isinstance(state.get("sampler"), dict):
        raise CheckpointCorrupt(f"{path} holds no sampler state (a 'sampler' object).")
    return state


def _is_hf_dataset(data) -> bool:
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(data, datasets.Dataset)


def _rng_file(world: int, rank: int) -> str:
    """The RNG file the Trainer restores a rank from (``Trainer._load_rng_state``)."""
    return "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"


class _MicroBatches(torch.utils.data.Sampler[list[int]]):
    """This rank's share of each global batch of ``sampler``, cut into ``accumulation`` contiguous
    micro-batches (the first ``share % accumulation`` one sample longer): one optimizer step's worth.

    Iteration starts at the trained frontier. The length is a whole epoch's micro-batches, as the
    Trainer expects of a sampler: it counts epochs and the steps already trained from it and
    ``global_step``; that is why the Trainer must not skip batches itself on resume."""

    def __init__(self, sampler: ElasticSampler, accumulation: int) -> None:
        self.sampler, self.accumulation = sampler, accumulation

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps (global batches) in an epoch."""
        return -(-self.sampler.epoch_samples // self.sampler.global_batch)

    def __iter__(self):
        for share in self.sampler:
            base, extra = divmod(len(share), self.accumulation)
            lo = 0
            for k in range(self.accumulation):
                hi = lo + base + (1 if k < extra else 0)
                yield share[lo:hi]
                lo = hi

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def set_epoch(self, epoch: int) -> None:
        """The Trainer begins ``epoch``, which must be the sampler's (it rolls over by itself)."""
        if epoch != self.sampler.epoch:
            raise FtrtError(f"The Trainer begins epoch {epoch} but ElasticSampler is in epoch {self.sampler.epoch}: "
                            "the Trainer's steps per epoch no longer match the sampler's global batches.")


class _ElasticProgress(TrainerCallback):
    """Moves the sampler's trained frontier once per optimizer step, checks it against the Trainer's
    ``global_step`` when training begins, and writes it into every checkpoint (rank 0, before the
    callbacks that commit the folder: :class:`ElasticData` puts this one first)."""

    def __init__(self, global_batch: int | None) -> None:
        if global_batch is not None and (not isinstance(global_batch, int) or global_batch < 1):
            raise ConfigError(f"ElasticTrainer global_batch = {global_batch!r}: give a whole number >= 1, or None.")
        self.global_batch = global_batch
        self.saved: dict[str, Any] | None = None  # the state of the checkpoint being resumed
        self.resumed_from: str | None = None
        self.batches: _MicroBatches | None = None

    def resume(self, checkpoint: str | None) -> None:
        self.resumed_from = checkpoint
        self.saved = _read_sampler_state(checkpoint) if checkpoint else None

    def start(self, size: int, args) -> _MicroBatches:
        """This rank's micro-batches over ``size`` samples, from the resumed checkpoint's frontier."""
        world, rank, accumulation = max(1, args.world_size), args.process_index, args.gradient_accumulation_steps
        saved = self.saved["sampler"] if self.saved else None
        batch = self.global_batch or (saved or {}).get("global_batch") \
            or args.per_device_train_batch_size * world * accumulation
        if batch < world * accumulation:
            raise ConfigError(f"ElasticTrainer global_batch = {batch} cannot give each of {world} ranks "
                              f"{accumulation} micro-batches (gradient_accumulation_steps) of one sample or more: "
                              f"give at least {world * accumulation}.")
        sampler = ElasticSampler(size, batch, rank=rank, world=world,
                                 seed=args.data_seed if args.data_seed is not None else args.seed)
        if saved is not None:
            sampler.load_state_dict(saved)
            self._warn_if_resharded(self.saved.get("world_size"), world, rank)
        self.batches = _MicroBatches(sampler, accumulation)
        return self.batches

    def _warn_if_resharded(self, saved_world: int | None, world: int, rank: int) -> None:
        if saved_world == world:
            return
        rng = _rng_file(world, rank)
        if os.path.isfile(os.path.join(self.resumed_from, rng)):
            how = f"the Trainer restores rank {rank}'s RNG from {rng}, which drew for other samples in the old world"
        else:
            how = (f"the Trainer finds no {rng} for rank {rank} and leaves its RNG as seeded at start (args.seed), "
                   "so dropout and every other random draw differ")
        log.warning("Resuming %s, saved by %s ranks, on %d: ElasticSampler goes on at the next global batch (nothing "
                    "skipped or repeated), but the run is not bit-identical to one without the change: %s; and each "
                    "step's gradient is reduced over other shares, so it rounds differently.",
                    self.resumed_from, saved_world, world, how)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.batches is None:
            raise FtrtError("ElasticData's get_train_dataloader did not build the training loader: a subclass "
                            "overrides it, so the data would not follow ElasticSampler.")
        sampler, per_epoch = self.batches.sampler, self.batches.steps_per_epoch
        epoch, steps = divmod(state.global_step, per_epoch)
        if (sampler.epoch, sampler.frontier) != (epoch, steps * sampler.global_batch):
            raise ConfigError(
                f"The checkpoint's data position (epoch {sampler.epoch}, sample {sampler.frontier}) is not where "
                f"global step {state.global_step} trains at {sampler.global_batch} samples a step and {per_epoch} "
                f"steps an epoch (epoch {epoch}, sample {steps * sampler.global_batch}): its files come from "
                "different runs.")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.batches.sampler.advance()  # one optimizer step: one global batch trained
        return control

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            loc = parse_url(str(Path(args.output_dir).absolute()))
            record = {"sampler": self.batches.sampler.state_dict(), "world_size": max(1, args.world_size),
                      "global_step": state.global_step}
            write_bytes(loc, loc.path(_folder(state.global_step), SAMPLER_FILE), json.dumps(record).encode())
        return control


_ELASTIC_LOADER = "_ftrt_elastic_loader"
"""Set on the loaders :class:`ElasticData` makes: they start at the trained frontier."""


def _let_elastic_loaders_pass() -> None:
    """Before transformers 5.25 the Trainer skips the batches of a resumed epoch with the
    ``skip_first_batches`` it imported from accelerate, with no ``get_resumed_dataloader`` hook to
    override: wrap that name (once per process) so that the loaders of :class:`ElasticData`, which
    already start at the trained frontier, pass unskipped; every other loader is skipped as before."""
    import transformers.trainer as hf_trainer

    skip = getattr(hf_trainer, "skip_first_batches", None)
    if skip is None:
        import transformers

        raise ConfigError(f"ElasticTrainer cannot turn off the Trainer's skipping on resume in transformers "
                          f"{transformers.__version__} (no get_resumed_dataloader, no skip_first_batches): "
                          "install transformers 5.24 or newer.")
    if getattr(skip, _ELASTIC_LOADER, False):
        return

    def skip_unless_elastic(dataloader, num_batches=0):
        return dataloader if getattr(dataloader, _ELASTIC_LOADER, False) else skip(dataloader, num_batches)

    setattr(skip_unless_elastic, _ELASTIC_LOADER, True)
    hf_trainer.skip_first_batches = skip_unless_elastic


class ElasticData:
    """Mix into a ``Trainer`` class to train the data in :class:`ftrt.data.ElasticSampler`'s order,
    with the sampler's state in every checkpoint and restored at any world size.

    ``global_batch``: samples per optimizer step, over all ranks and accumulation steps, the same at
    every world size. None: the resumed checkpoint's, else ``per_device_train_batch_size`` x world
    size x ``gradient_accumulation_steps`` of this launch. Each rank takes its share of a global
    batch (contiguous; the first ``global_batch % world`` ranks one sample more) cut into
    ``gradient_accumulation_steps`` micro-batches. The order of an epoch is drawn from
    ``(args.data_seed or args.seed, epoch)``; an epoch trains whole global batches only (the last
    ``len(train_dataset) % global_batch`` samples of its order wait for another epoch's order).

    Needs a map-style ``train_dataset`` (with a length) and data parallelism in which every rank
    takes its own data (DDP, FSDP); accelerate's ``dispatch_batches`` and ``split_batches`` are
    refused. The Trainer's own skipping on resume is turned off (the loader starts at the trained
    frontier), but not its step counting: leave ``ignore_data_skip`` False, which keeps the
    Trainer's RNG restore after the loader has started (bit-identical at the same world size).
    """

    def __init__(self, *args, global_batch: int | None = None, **kwargs) -> None:
        if not hasattr(Trainer, "get_resumed_dataloader"):
            _let_elastic_loaders_pass()
        _stop_at_max_steps()
        super().__init__(*args, **kwargs)
        self._elastic = _ElasticProgress(global_batch)
        self.callback_handler.callbacks.insert(0, self._elastic)  # its on_save before any commit

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``, first reading the data position of ``resume_from_checkpoint``."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # True: the Trainer's error
        self._elastic.resume(resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None)
        if self.args.ignore_data_skip and self._elastic.saved is not None:
            log.warning("ignore_data_skip=True: ElasticTrainer skips nothing anyway, but with it the Trainer restores "
                        "the RNG before the loader starts, which draws a seed from it: the resumed run is not "
                        "bit-identical even at the same world size. Leave it False.")
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """This rank's micro-batches, from the trained frontier, prepared by accelerate (which must
        not shard them again)."""
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher

        data, collate, args = self.train_dataset, self.data_collator, self.args
        if data is None or isinstance(data, torch.utils.data.IterableDataset) or not has_length(data):
            raise ConfigError("ElasticTrainer needs a train_dataset with a length (map-style): ElasticSampler "
                              f"orders samples by index, and {type(data).__name__} has none.")
        batches = self._elastic.start(len(data), args)
        if _is_hf_dataset(data):  # the columns the model does not take go, as in Trainer._get_dataloader
            data = self._remove_unused_columns(data, description="Training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="Training")
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=batches, collate_fn=collate, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor, in_order=args.dataloader_in_order,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index))
        prepared = self.accelerator.prepare(loader)
        setattr(prepared, _ELASTIC_LOADER, True)
        shard = getattr(prepared, "batch_sampler", None)
        if isinstance(shard, BatchSamplerShard) and shard.batch_sampler is batches and not shard.split_batches:
            # Already this rank's share: make accelerate's round-robin over ranks a passthrough, as the
            # Trainer does for its own rank-aware BatchRebalanceSampler.
            shard.num_processes, shard.process_index = 1, 0
        elif shard is not batches or isinstance(prepared, DataLoaderDispatcher):
            raise ConfigError(f"accelerate prepared ElasticTrainer's loader as {type(prepared).__name__} over "
                              f"{type(shard).__name__}: turn off dispatch_batches and split_batches "
                              "(TrainingArguments.accelerator_config); each rank must read its own share.")
        return prepared

    def get_resumed_dataloader(self, dataloader: torch.utils.data.DataLoader,
                               num_batches: int) -> torch.utils.data.DataLoader:
        """No skipping: the loader already starts at the trained frontier (checked against
        ``global_step`` when training begins)."""
        return dataloader


class ElasticTrainer(ElasticData, Trainer):
    """The Hugging Face ``Trainer`` with :class:`ftrt.data.ElasticSampler` as its data order
    (:class:`ElasticData`): ``ElasticTrainer(model, args, ..., global_batch=64)``."""
