"""``model.hf_path``: a Hugging Face causal LM (a tiny GPT-2 built here) trained by ftrt.grpo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from ftrt.errors import ConfigError  # noqa: E402
from ftrt.policy.model import HFPolicy  # noqa: E402
from ftrt.policy.tasks import Reverse, TokenizerVocab  # noqa: E402


def save_task_tokenizer(path) -> list[str]:
    """A tokenizer in which every symbol of the built-in tasks (16 letters) is one token; its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<pad>", "<bos>", "<eos>", "=", *"abcdefghijklmnop"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                         bos_token="<bos>", eos_token="<eos>").save_pretrained(path)
    return words


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    words = save_task_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(words), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                  bos_token_id=2, eos_token_id=3, pad_token_id=1)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def test_hf_policy_decodes_with_its_cache_like_a_full_forward(tiny_gpt2):
    policy = HFPolicy(str(tiny_gpt2)).eval()
    vocab = TokenizerVocab(Reverse(length=4, alphabet=8), policy.tokenizer)
    assert (vocab.bos, vocab.eos, vocab.pad, vocab.sep) == (2, 3, 1, 4)
    x = torch.tensor([[vocab.bos, *vocab.encode(list("abcd")), vocab.sep, *vocab.encode(list("dc"))]])
    with torch.no_grad():
        full, _ = policy(x)
        logits, cache = policy(x[:, :6])
        step, _ = policy(x[:, 6:7], cache, 6)
    assert torch.allclose(step[:, -1], full[:, 6], atol=1e-5)


def test_a_task_symbol_the_tokenizer_lacks_is_a_clear_error(tiny_gpt2):
    policy = HFPolicy(str(tiny_gpt2))
    with pytest.raises(ConfigError, match="Task symbol 'q' is not a single token"):
        TokenizerVocab(Reverse(length=4, alphabet=17), policy.tokenizer)
    with pytest.raises(ConfigError, match="model.hf_path' = '/nonexistent'"):
        HFPolicy("/nonexistent")


def test_grpo_trains_and_resumes_a_hugging_face_model(tiny_gpt2, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = [sys.executable, "-m", "ftrt.grpo", f"model.hf_path={tiny_gpt2}", "task.params={length: 3, alphabet: 6}",
            "prompts_per_step=8", "group_size=4", f"metrics_path={metrics}", f"checkpoint.url={tmp_path / 'ck'}",
            "progress=none"]
    first = subprocess.run([*args, "steps=4"], capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    again = subprocess.run([*args, "steps=6"], capture_output=True, text=True, timeout=180)
    assert again.returncode == 0 and "resumed at step 4 of 6" in again.stdout, again.stdout + again.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert all(0.0 <= x["reward_mean"] <= 1.0 for x in lines)
