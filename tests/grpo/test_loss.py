"""The GRPO objective's pure functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ftrt.grpo.loss import aggregate, clipped_surrogate, group_advantages, k3_kl


def test_group_advantages_centre_and_scale_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    a = group_advantages(r, std_norm=False)
    assert torch.allclose(a, torch.tensor([[0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    a = group_advantages(r, std_norm=True, eps=0.0)
    std = math.sqrt((0.25 + 0.25) / 4)  # population std of (1, 0, .5, .5)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, 0.0, 0.0]) / std)
    assert torch.equal(group_advantages(r)[1], torch.zeros(4))  # a uniform group teaches nothing


def test_clipped_surrogate_clips_low_and_high_separately():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    pos = clipped_surrogate(logp, old, torch.tensor([2.0]), eps_low=0.2, eps_high=0.3)
    # A > 0: min(rA, clip(r)A) -> ratio capped at 1.3; a low ratio is not raised (0.5 < 0.8).
    assert torch.allclose(pos, -torch.tensor([[1.3 * 2, 0.5 * 2, 1.1 * 2]]))
    neg = clipped_surrogate(logp, old, torch.tensor([-1.0]), eps_low=0.2, eps_high=0.3)
    # A < 0: min picks the larger ratio term -> 1.5 stays, 0.5 is raised to 0.8.
    assert torch.allclose(neg, torch.tensor([[1.5, 0.8, 1.1]]))


def test_clipped_surrogate_gradient_vanishes_where_clipped():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([1.0]), 0.2, 0.3).sum().backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] == pytest.approx(-1.1)


def test_k3_kl_matches_its_formula_and_is_zero_when_equal():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    # exp(ref - logp) - (ref - logp) - 1
    expected = torch.tensor([0.5 - math.log(0.5) - 1, 2.0 - math.log(2.0) - 1])
    assert torch.allclose(k3_kl(logp, ref), expected)
    assert torch.equal(k3_kl(ref, ref), torch.zeros(2))
    assert bool((k3_kl(logp, ref) >= 0).all())


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)


def test_token_mean_weights_every_token_equally():
    assert aggregate(PER_TOKEN, MASK, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(PER_TOKEN, MASK, "token_mean", total_tokens=8).item() == pytest.approx(10 / 8)


def test_seq_mean_weights_every_sequence_equally():
    assert aggregate(PER_TOKEN, MASK, "seq_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(PER_TOKEN, MASK, "seq_mean", total_seqs=4).item() == pytest.approx(6.0 / 4)


def test_dr_grpo_divides_by_a_constant_not_by_lengths():
    assert aggregate(PER_TOKEN, MASK, "dr_grpo").item() == pytest.approx(10 / (2 * 4))
    assert aggregate(PER_TOKEN, MASK, "dr_grpo", total_seqs=4, max_len=5).item() == pytest.approx(10 / 20)


def test_global_normalisers_make_rank_losses_sum_to_the_one_process_loss():
    for mode in ("token_mean", "seq_mean", "dr_grpo"):
        whole = aggregate(PER_TOKEN, MASK, mode, max_len=4)
        parts = sum(aggregate(PER_TOKEN[i:i + 1], MASK[i:i + 1], mode, total_tokens=4, total_seqs=2, max_len=4)
                    for i in range(2))
        assert parts.item() == pytest.approx(whole.item()), mode


def test_unknown_aggregation_is_an_error():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(PER_TOKEN, MASK, "mean")
