"""A Hugging Face ``Trainer`` job under ftrt: ``ftrt launch --nproc-per-node 2 -m ftrt.examples.hf_trainer``.

A tiny random-init Llama and a character tokenizer are made here and saved locally (nothing is
downloaded); the data are fixed pseudo-random token sequences. The script adds two lines to a
plain Trainer script: ``callbacks=[FtrtCallback()]`` and ``resume_from_checkpoint=
resume_checkpoint(out)``. Rank 0 appends ``{"step", "loss"}`` per logged step to ``--metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ftrt.integrations.hf import FtrtCallback, resume_checkpoint

VOCAB = 32


class Sequences(torch.utils.data.Dataset):
    """``n`` fixed token sequences of length ``length`` (language-model labels = inputs)."""

    def __init__(self, n: int, length: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(3, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class LossLog(TrainerCallback):
    def __init__(self, path: str | None) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.path and state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"],
                                    "grad_norm": logs.get("grad_norm"), "time": time.time()}) + "\n")
        return control


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--metrics", default=None, help="rank 0 appends one JSON line per logged step here")
    p.add_argument("--no-ftrt", action="store_true", help="the plain Trainer script, without ftrt's two lines "
                   "(the baseline of python -m bench hf_callback)")
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
                              disable_tqdm=True)
    extra = [] if args.no_ftrt else [FtrtCallback()]
    trainer = Trainer(model=model, args=targs, train_dataset=Sequences(64, 16), callbacks=[*extra, LossLog(args.metrics)])
    trainer.train(resume_from_checkpoint=None if args.no_ftrt else resume_checkpoint(args.out))


if __name__ == "__main__":
    main()
