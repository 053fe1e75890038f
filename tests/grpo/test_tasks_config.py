"""Tasks, prompts, sampling streams and configuration: deterministic, validated, clear errors."""

from __future__ import annotations

import pytest
import torch

from ftrt.errors import ConfigError
from ftrt.grpo.config import load_config
from ftrt.policy.model import TinyLM
from ftrt.policy.sample import make_prompts, pick, rollout, uniforms
from ftrt.policy.tasks import Add, Reverse, Vocab, make_task, positional_credit, prompt_rng, register_task
from ftrt.grpo.trainer import shard


def test_partial_credit_rewards():
    assert positional_credit(list("abc"), list("abc")) == 1.0
    assert positional_credit(list("abc"), list("abx")) == pytest.approx(2 / 3)
    assert positional_credit(list("abc"), list("abcdef")) == pytest.approx(3 / 6)  # too long costs
    assert positional_credit(list("abc"), []) == 0.0
    t = Add(digits=2)
    p, a = t.make(prompt_rng(0, 7))
    x, y = "".join(p).split("+")
    assert int("".join(a)) == int(x) + int(y) and len(a) == 3


def test_prompts_depend_only_on_seed_and_prompt_id():
    task = Reverse()
    assert task.make(prompt_rng(3, 41)) == task.make(prompt_rng(3, 41))
    assert task.make(prompt_rng(3, 41)) != task.make(prompt_rng(3, 42))
    p, a = task.make(prompt_rng(0, 0))
    assert a == p[::-1] and len(p) == 6 and set(p) <= set(task.symbols)


def test_a_random_policy_scores_at_most_a_tenth_on_the_default_task():
    torch.manual_seed(0)
    task = Reverse()
    vocab = Vocab(task)
    model = TinyLM(len(vocab), 32, 1, 2, 32)
    batch = rollout(model, task, vocab, seed=0, step=0, prompt_ids=list(range(64)), group=4, max_new=6,
                    temperature=1.0)
    assert batch.rewards.mean().item() <= 0.1


def test_samples_do_not_depend_on_which_batch_or_rank_draws_them():
    u_all = uniforms(5, 3, [10, 11, 12], 2, 6)
    u_one = uniforms(5, 3, [11], 2, 6)
    assert torch.equal(u_all[2:4], u_one)
    task = Reverse(length=4, alphabet=4)
    vocab = Vocab(task)
    torch.manual_seed(0)
    model = TinyLM(len(vocab), 16, 1, 2, 16)
    whole = rollout(model, task, vocab, seed=1, step=2, prompt_ids=[0, 1, 2, 3], group=3, max_new=5, temperature=1.0)
    part = rollout(model, task, vocab, seed=1, step=2, prompt_ids=[2, 3], group=3, max_new=5, temperature=1.0)
    assert torch.equal(whole.sequences[6:], part.sequences) and torch.equal(whole.rewards[2:], part.rewards)


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).repeat(3, 1)
    assert pick(logits, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64), 1.0).tolist() == [0, 1, 2]


def test_kv_cache_decoding_matches_a_full_forward():
    torch.manual_seed(0)
    model = TinyLM(10, 16, 2, 2, 12)
    x = torch.randint(0, 10, (3, 8))
    full, _ = model(x)
    logits, cache = model(x[:, :5])
    steps = [logits[:, -1]]
    for t in range(5, 8):
        logits, cache = model(x[:, t:t + 1], cache, t)
        steps.append(logits[:, -1])
    assert torch.allclose(torch.stack(steps[:-1], 1), full[:, 4:7], atol=1e-5)


def test_prompts_are_encoded_with_bos_and_sep():
    task = Reverse(length=3, alphabet=4)
    vocab = Vocab(task)
    prompts, answers = make_prompts(task, vocab, 0, [0, 1])
    assert prompts.shape == (2, 5) and (prompts[:, 0] == vocab.bos).all() and (prompts[:, -1] == vocab.sep).all()
    assert vocab.decode_completion(vocab.encode(answers[0]) + [vocab.eos, 5]) == answers[0]


def test_ranks_split_the_global_batch_whatever_the_world_size():
    for n, world in ((32, 1), (32, 2), (32, 3), (5, 8)):
        parts = [shard(n, world, r) for r in range(world)]
        covered = [i for lo, hi in parts for i in range(lo, hi)]
        assert covered == list(range(n)), (n, world)


def test_config_from_yaml_and_dotted_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 50\ncheckpoint:\n  interval: 5\ntask:\n  name: add\n  params: {digits: 2}\n")
    cfg = load_config(f, ["checkpoint.url=/tmp/x", "lr=3e-4", "model.d_model=64", "loss_agg=dr_grpo"])
    assert (cfg.steps, cfg.checkpoint.interval, cfg.checkpoint.url, cfg.lr) == (50, 5, "/tmp/x", 3e-4)
    assert cfg.task.name == "add" and cfg.model.d_model == 64 and cfg.loss_agg == "dr_grpo"


@pytest.mark.parametrize("override, field", [
    ("steps=0", "'steps' = 0"),
    ("lr=-1", "'lr' = -1"),
    ("loss_agg=mean", "'loss_agg' = 'mean'"),
    ("model.n_heads=5", "'model'"),
    ("checkpoint.interval=x", "'checkpoint.interval' = 'x'"),
    ("nosuch=1", "Unknown config field 'nosuch'"),
    ("steps", "not KEY=VALUE"),
])
def test_bad_config_values_are_rejected_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value)


def test_unknown_task_and_parameters_are_clear_errors():
    with pytest.raises(ConfigError, match="'task.name' = 'nope'.*known tasks are add, reverse"):
        make_task("nope", {})
    with pytest.raises(ConfigError, match="'task.params.size' is not a parameter of task 'reverse'"):
        make_task("reverse", {"size": 3})
    with pytest.raises(ConfigError, match="'task.params.alphabet' = 99"):
        make_task("reverse", {"alphabet": 99})


def test_users_register_their_own_task():
    @register_task("echo-test")
    def echo(length: int = 3) -> Reverse:
        t = Reverse(length=length, alphabet=4)
        t.make = lambda rng: ((p := [rng.choice(t.symbols) for _ in range(length)]), p)
        return t

    t = make_task("echo-test", {"length": 2})
    p, a = t.make(prompt_rng(0, 0))
    assert p == a and len(p) == 2
