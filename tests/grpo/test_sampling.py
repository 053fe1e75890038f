"""A step trained again in place reuses this rank's own completions of its first attempt."""

from __future__ import annotations

import torch

from ftrt.grpo.config import load_config
from ftrt.grpo.sampling import LocalSampling
from ftrt.policy.setting import build_setting


def test_a_redone_step_samples_only_the_prompts_it_did_not_have_and_reuses_the_rest():
    cfg = load_config(None, ["prompts_per_step=6", "group_size=4", "model.d_model=32", "model.n_layers=1",
                             "model.n_heads=2"])
    built = build_setting(cfg.model, cfg.task, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens)
    sampling = LocalSampling(cfg, built.task, built.vocab, built.model, built.max_new)
    first = sampling.sample(3, [0, 1, 2], frontier=0)  # rank 0 of 2, before its peer was lost
    assert first.reused_s == 0 and "reused_prompts" not in first.info
    again = sampling.sample(3, [0, 1, 2, 3, 4, 5], frontier=0)  # the same step at world 1
    assert again.info["reused_prompts"] == 3 and again.reused_s > 0
    g = cfg.group_size
    assert torch.equal(again.batch.sequences[:3 * g], first.batch.sequences)
    # the prompts it had not: what sampling them alone gives
    fresh = LocalSampling(cfg, built.task, built.vocab, built.model, built.max_new).sample(3, [3, 4, 5], frontier=0)
    assert torch.equal(again.batch.sequences[3 * g:], fresh.batch.sequences)
    # another step reuses nothing
    assert sampling.sample(4, [0, 1, 2], frontier=6).reused_s == 0
