"""A Hugging Face ``Trainer`` job under ftrt: ``ftrt launch --nproc-per-node 2 -m ftrt.examples.hf_trainer``.

A tiny random-init Llama and a character tokenizer are made here and saved locally (nothing is
downloaded); the data are fixed pseudo-random token sequences. The script adds two lines to a
plain Trainer script: ``callbacks=[FtrtCallback()]`` and ``resume_from_checkpoint=
resume_checkpoint(out)``. Rank 0 appends ``{"step", "loss", "grad_norm", "epoch", "time"}`` per logged step to ``--metrics``.

``--elastic`` trains the data in :class:`ftrt.data.ElasticSampler`'s order (``ElasticTrainer``,
``--global-batch`` samples a step), which survives a world-size change without skipping or
repeating a sample. ``--ledger PATH``: every rank appends, per optimizer step, the ids of the
samples it trained (``{"step", "round", "rank", "world", "ids"}``), read from the batches the
model was fed. ``--hold-after N --hold-file P`` stops every rank after step N's checkpoint until P
exists (a test's fixed point).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import ftrt
from ftrt.integrations.hf import ElasticTrainer, FtrtCallback, resume_checkpoint

VOCAB = 32


class Sequences(torch.utils.data.Dataset):
    """``n`` fixed token sequences of length ``length`` (language-model labels = inputs)."""

    def __init__(self, n: int, length: int, seed: int = 0, with_ids: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(3, VOCAB, (n, length), generator=g)
        self.with_ids = with_ids

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        row = {"input_ids": self.data[i], "labels": self.data[i]}
        return {**row, "idx": i} if self.with_ids else row


class Ledger(TrainerCallback):
    """Appends this rank's trained sample ids once per optimizer step (``--ledger``)."""

    def __init__(self, path: str) -> None:
        self.path, self.ids = path, []
        self.rt = ftrt.init()

    def on_step_end(self, args, state, control, **kwargs):
        line = {"step": state.global_step, "round": self.rt.round, "rank": args.process_index,
                "world": args.world_size, "ids": self.ids}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())  # one write: whole lines from every rank
        finally:
            os.close(fd)
        self.ids = []
        return control


def with_ledger(base: type[Trainer], ledger: Ledger) -> type[Trainer]:
    """``base`` taking each micro-batch's sample ids out before the model sees them, into ``ledger``."""

    class LedgerTrainer(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            ledger.ids.extend(inputs.pop("idx").tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    return LedgerTrainer


class Hold(TrainerCallback):
    """After step ``step``'s save, wait until ``file`` exists (``--hold-after``, ``--hold-file``: a
    test's fixed point, e.g. to act on the job while it surely has steps left)."""

    def __init__(self, step: int, file: str) -> None:
        self.step, self.file = step, Path(file)

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            while not self.file.exists():
                time.sleep(0.05)
        return control


class Pace(TrainerCallback):
    """Sleep ``seconds`` after every optimizer step (``--step-time``: steps as slow as a test needs)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        return control


class LossLog(TrainerCallback):
    def __init__(self, path: str | None) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.path and state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"],
                                    "grad_norm": logs.get("grad_norm"), "epoch": logs.get("epoch"),
                                    "time": time.time()}) + "\n")
        return control


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--metrics", default=None, help="rank 0 appends one JSON line per logged step here")
    p.add_argument("--no-ftrt", action="store_true", help="the plain Trainer script, without ftrt's two lines "
                   "(the baseline of python -m bench trainers)")
    p.add_argument("--elastic", action="store_true", help="ElasticSampler's data order (ElasticTrainer)")
    p.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step with --elastic")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--ledger", default=None, help="every rank appends the sample ids it trained, per step")
    p.add_argument("--hold-after", type=int, default=0, help="every rank waits after this step's save ...")
    p.add_argument("--hold-file", default=None, help="... until this file exists")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                      num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.1,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2,
                              learning_rate=1e-3, logging_steps=1, save_steps=args.save_steps, seed=0,
                              use_cpu=True, report_to=[], dataloader_num_workers=0,
                              ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
                              disable_tqdm=True, gradient_accumulation_steps=args.grad_accum,
                              remove_unused_columns=not args.ledger)  # the ids reach training_step
    callbacks = [] if args.no_ftrt else [FtrtCallback()]
    cls, extra = (ElasticTrainer, {"global_batch": args.global_batch}) if args.elastic else (Trainer, {})
    if args.ledger:
        ledger = Ledger(args.ledger)
        cls, callbacks = with_ledger(cls, ledger), [*callbacks, ledger]
    trainer = cls(model=model, args=targs, train_dataset=Sequences(64, 16, with_ids=bool(args.ledger)),
                  callbacks=[*callbacks, LossLog(args.metrics)], **extra)
    if args.hold_after:
        trainer.add_callback(Hold(args.hold_after, args.hold_file))
    trainer.train(resume_from_checkpoint=None if args.no_ftrt else resume_checkpoint(args.out))


if __name__ == "__main__":
    main()
