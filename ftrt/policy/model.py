"""The built-in policy: a small pre-norm causal transformer with a KV cache for sampling.

Learned token and position embeddings, ``n_layers`` blocks of multi-head attention and a GELU
MLP, a final norm and an untied output layer. Small enough for CPU: the default (96 wide, 2
layers) has ~229k parameters. :class:`HFPolicy` puts a local Hugging Face causal LM
behind the same interface (``model.hf_path``; needs the ``hf`` extra).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        # With a cache, the new tokens see every cached one; without, attention is causal.
        causal = cache is None and t > 1
        if cache is not None and t > 1:
            raise ValueError("decode one token at a time once a cache exists")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return x, (k, v)


class TinyLM(nn.Module):
    """A causal language model over a small vocabulary."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start: int = 0):
        """Logits for ``tokens`` (B, T) at positions ``start..start+T-1``; returns (logits, cache)."""
        t = tokens.shape[1]
        if start + t > self.max_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the model's max_len {self.max_len}")
        pos = torch.arange(start, start + t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        new: KVCache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i])
            new.append(kv)
        return self.head(self.ln(x)), new


class HFPolicy(nn.Module):
    """A Hugging Face causal LM from a local path behind :class:`TinyLM`'s interface.

    ``forward(tokens, cache, start)`` returns ``(logits, cache)``; the cache is the model's own
    ``past_key_values``. The tokenizer saved beside the model maps the task's symbols to ids
    (see :class:`ftrt.policy.tasks.TokenizerVocab`).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer  # type: ignore[import-not-found]
        except ImportError:
            from ftrt.errors import ConfigError

            raise ConfigError("Config field 'model.hf_path' needs transformers: pip install 'ftrt[hf]'.") from None
        try:
            # a local folder (never a download)
            self.lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            from ftrt.errors import ConfigError

            raise ConfigError(f"Config field 'model.hf_path' = {path!r}: cannot load a causal LM and its "
                              f"tokenizer there ({str(exc).splitlines()[0]}).") from None

        # transformers 5.x renamed ``past_key_values`` to ``cache``; older releases know only the former.
        import inspect

        accepted = inspect.signature(self.lm.forward).parameters
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"

    def forward(self, tokens: torch.Tensor, cache=None, start: int = 0):
        out = self.lm(input_ids=tokens, use_cache=True, **{self._cache_arg: cache})
        new = getattr(out, "cache", None)
        return out.logits, new if new is not None else out.past_key_values


def build_policy(cfg, vocab_size: int, max_len: int) -> nn.Module:
    """The policy the config asks for (seeded by the caller for identical init on every rank)."""
    if cfg.hf_path:
        return HFPolicy(cfg.hf_path)
    return TinyLM(vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, max_len)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
