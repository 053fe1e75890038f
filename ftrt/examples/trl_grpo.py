"""TRL's ``GRPOTrainer`` under ftrt: ``ftrt launch --nproc-per-node 2 -m ftrt.examples.trl_grpo --out DIR``.

A tiny random-init Llama and a character tokenizer are made here (nothing is downloaded); the
prompts are fixed strings and the reward is the share of ``a`` in a completion. Each generation
holds ``--generation-batch-size`` completions at any world size; its window spans
``--num-iterations x steps_per_generation`` steps (TRL derives the latter from the world size), so
most checkpoints fall inside one. The script adds two lines to a plain TRL script:
``trainer.add_callback(FtrtCallback(trainer))`` and ``resume_from_checkpoint=resume_checkpoint(trainer)``.

Rank 0 appends ``{"step", "loss", "grad_norm", "epoch", "time"}`` per logged step to ``--metrics``; with
``--ledger``, every rank appends the prompts of each generation it scores (and a line when it
starts) so a test can check that no prompt was skipped or trained twice. ``--hold-after N
--hold-file P`` stops every rank after step N's checkpoint until P exists (a test's fixed point);
``--step-time S`` sleeps S seconds after every step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from ftrt.examples.hf_trainer import Hold, LossLog, Pace  # the same {"step", "loss", "grad_norm", "epoch", "time"} lines

CHARS = "abcdefghijklmnopqrstuvwxyz ."
PROMPTS = [f"say {w}." for w in "aa ab ba bb ca ac cc da ad dd ea ae ee fa af ff".split()]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``CHARS``, plus pad, bos, eos and unk."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")


def share_of_a(completions: list[str], **_) -> list[float]:
    return [c.count("a") / max(len(c), 1) for c in completions]


class Ledger(TrainerCallback):
    """Appends this rank's start (the resumed step) and, as a reward function, each generation's prompts."""

    __name__ = "ledger"

    def __init__(self, path: str) -> None:
        import ftrt

        rt = ftrt.init()
        self.path, self.rank, self.round = path, rt.rank, rt.round

    def _write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"round": self.round, "rank": self.rank, **row}) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._write({"start": state.global_step})
        return control

    def __call__(self, prompts: list[str], completions: list[str], trainer_state=None, **_) -> list[float]:
        self._write({"step": trainer_state.global_step, "prompts": prompts})
        return [0.0] * len(completions)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--num-iterations", type=int, default=2)
    p.add_argument("--generation-batch-size", type=int, default=8, help="completions per generation (all ranks)")
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--metrics", default=None, help="rank 0 appends one JSON line per logged step here")
    p.add_argument("--ledger", default=None, help="every rank appends the prompts of each generation here")
    p.add_argument("--hold-after", type=int, default=0)
    p.add_argument("--hold-file", default=None)
    p.add_argument("--step-time", type=float, default=0.0, help="sleep this long after each step (seconds)")
    p.add_argument("--ftrt", choices=("trl", "hf", "none"), default="trl",
                   help="trl: ftrt's TRL callback (buffers checkpointed); hf: only the Trainer's callback (TRL's "
                        "resume gap stays); none: the plain TRL script (the baseline of python -m bench)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tok = char_tokenizer()
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                      num_hidden_layers=2, vocab_size=len(tok), max_position_embeddings=64, attention_dropout=0.1,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = GRPOConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2, num_generations=2,
                        num_iterations=args.num_iterations, generation_batch_size=args.generation_batch_size,
                        max_completion_length=6, learning_rate=1e-3, logging_steps=1, save_steps=args.save_steps,
                        seed=0, use_cpu=True, report_to=[], dataloader_num_workers=0, disable_tqdm=True,
                        ddp_backend="gloo" if world > 1 else None)
    ledger = [Ledger(args.ledger)] if args.ledger else []
    trainer = GRPOTrainer(model=model, reward_funcs=[share_of_a, *ledger], args=config, train_dataset=prompts,
                          processing_class=tok, callbacks=[LossLog(args.metrics), *ledger])
    resume = None
    if args.ftrt == "trl":
        from ftrt.integrations.trl import FtrtCallback, resume_checkpoint

        trainer.add_callback(FtrtCallback(trainer))
        resume = resume_checkpoint(trainer)
    elif args.ftrt == "hf":
        from ftrt.integrations.hf import FtrtCallback, resume_checkpoint

        trainer.add_callback(FtrtCallback())
        resume = resume_checkpoint(args.out)
    if args.hold_after:
        trainer.add_callback(Hold(args.hold_after, args.hold_file))
    if args.step_time:
        trainer.add_callback(Pace(args.step_time))
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
