"""What a GRPO job's sampling is built from: the task, its vocabulary and the policy.

The trainer and a rollout server (:mod:`ftrt.rollout.engine`) build it the same way from the same
fields, so a server's policy has the trainer's parameter names, shapes and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftrt.policy.config import ModelConfig, TaskConfig
from ftrt.policy.model import build_policy
from ftrt.policy.tasks import Task, TokenizerVocab, Vocab, make_task


@dataclass(frozen=True)
class Setting:
    """A task, its vocabulary, a freshly initialised policy and the sequence lengths."""

    task: Task
    vocab: Vocab | TokenizerVocab
    model: torch.nn.Module
    max_new: int
    """Completion tokens per sample (the config's cap, else the task's answer length)."""
    prompt_len: int
    """Tokens per prompt with BOS and SEP."""


def build_setting(model_cfg: ModelConfig, task_cfg: TaskConfig, *, seed: int, max_new_tokens: int) -> Setting:
    """Build the task and the policy (initialised from ``seed``: the same weights wherever built)."""
    task = make_task(task_cfg.name, task_cfg.params)
    max_new = max_new_tokens or task.answer_len
    prompt_len = task.prompt_len + 2
    torch.manual_seed(seed)
    if model_cfg.hf_path:
        model = build_policy(model_cfg, 0, prompt_len + max_new)
        vocab: Vocab | TokenizerVocab = TokenizerVocab(task, model.tokenizer)
    else:
        vocab = Vocab(task)
        model = build_policy(model_cfg, len(vocab), prompt_len + max_new)
    return Setting(task=task, vocab=vocab, model=model, max_new=max_new, prompt_len=prompt_len)
