"""Tasks with verifiable rewards: prompts from ``(seed, prompt_id)``, rewards in [0, 1].

A task is a small object (:class:`Task`): its symbols, a fixed prompt and answer length, a way to
make prompt ``i`` of a run, and a reward with partial credit so a tiny model can learn from
scratch. Users add their own with :func:`register_task`::

    from ftrt.policy.tasks import Task, register_task

    @register_task("upper")
    def make_upper(length: int = 6) -> Task:
        ...

Built in: ``reverse`` (reverse ``length`` symbols over an ``alphabet``-symbol alphabet; a random
policy scores ~0.05 at the defaults: 6 symbols over 16) and ``add`` (sum of two ``digits``-digit numbers).
"""

from __future__ import annotations

import hashlib
import inspect
import random
import string
from dataclasses import dataclass
from typing import Callable, Protocol

from ftrt.errors import ConfigError

PAD, BOS, SEP, EOS = "<pad>", "<bos>", "=", "<eos>"
SPECIALS = (PAD, BOS, SEP, EOS)


class Task(Protocol):
    """What the trainer needs from a task."""

    symbols: list[str]
    """The task's symbols (one token each), besides the special tokens."""
    prompt_len: int
    """Tokens in every prompt (the trainer adds BOS before and SEP after)."""
    answer_len: int
    """Tokens in a correct answer (before EOS)."""

    def make(self, rng: random.Random) -> tuple[list[str], list[str]]:
        """A prompt and its correct answer, drawn from ``rng``."""

    def reward(self, answer: list[str], completion: list[str]) -> float:
        """Score in [0, 1] for ``completion`` (the symbols before EOS) against ``answer``."""


def positional_credit(answer: list[str], completion: list[str]) -> float:
    """Fraction of positions right, over the longer of answer and completion (too long costs)."""
    right = sum(1 for a, c in zip(answer, completion) if a == c)
    return right / max(len(answer), len(completion), 1)


@dataclass
class Reverse:
    """Reverse ``length`` symbols drawn from the first ``alphabet`` letters."""

    length: int = 6
    alphabet: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.length <= 64:
            raise ConfigError(f"Config field 'task.params.length' = {self.length!r} is invalid: use 1 to 64.")
        if not 2 <= self.alphabet <= 52:
            raise ConfigError(f"Config field 'task.params.alphabet' = {self.alphabet!r} is invalid: use 2 to 52.")
        self.symbols = list((string.ascii_lowercase + string.ascii_uppercase)[: self.alphabet])
        self.prompt_len = self.answer_len = self.length

    def make(self, rng: random.Random) -> tuple[list[str], list[str]]:
        p = [rng.choice(self.symbols) for _ in range(self.length)]
        return p, p[::-1]

    def reward(self, answer: list[str], completion: list[str]) -> float:
        return positional_credit(answer, completion)


@dataclass
class Add:
    """``a+b`` for two ``digits``-digit numbers; the answer has ``digits + 1`` digits, zero-padded."""

    digits: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 18:
            raise ConfigError(f"Config field 'task.params.digits' = {self.digits!r} is invalid: use 1 to 18.")
        self.symbols = list("0123456789+")
        self.prompt_len = 2 * self.digits + 1
        self.answer_len = self.digits + 1

    def make(self, rng: random.Random) -> tuple[list[str], list[str]]:
        a, b = (rng.randrange(10 ** self.digits) for _ in range(2))
        prompt = f"{a:0{self.digits}d}+{b:0{self.digits}d}"
        return list(prompt), list(f"{a + b:0{self.digits + 1}d}")

    def reward(self, answer: list[str], completion: list[str]) -> float:
        return positional_credit(answer, completion)


_REGISTRY: dict[str, Callable[..., Task]] = {"reverse": Reverse, "add": Add}


def register_task(name: str, factory: Callable[..., Task] | None = None):
    """Register ``factory(**params) -> Task`` under ``name`` (usable as a decorator)."""

    def add(f: Callable[..., Task]) -> Callable[..., Task]:
        _REGISTRY[name] = f
        return f

    return add(factory) if factory is not None else add


def make_task(name: str, params: dict) -> Task:
    """The task ``name`` built with ``params``; a clear error for an unknown name or parameter."""
    if name not in _REGISTRY:
        raise ConfigError(f"Config field 'task.name' = {name!r} is invalid: known tasks are "
                          f"{', '.join(sorted(_REGISTRY))} (register your own with ftrt.policy.tasks.register_task).")
    factory = _REGISTRY[name]
    accepted = inspect.signature(factory).parameters
    for key in params:
        if key not in accepted:
            raise ConfigError(f"Config field 'task.params.{key}' is not a parameter of task {name!r} "
                              f"(it takes: {', '.join(accepted) or 'nothing'}).")
    return factory(**params)


def prompt_rng(seed: int, prompt_id: int) -> random.Random:
    """The random stream prompt ``prompt_id`` of run ``seed`` is drawn from (stable everywhere)."""
    digest = hashlib.blake2b(f"ftrt-prompt/{seed}/{prompt_id}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


class Vocab:
    """Token ids: the specials, then the task's symbols."""

    def __init__(self, task: Task) -> None:
        self.tokens = [*SPECIALS, *task.symbols]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad, self.bos, self.sep, self.eos = (self.ids[t] for t in SPECIALS)

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, symbols: list[str]) -> list[int]:
        return [self.ids[s] for s in symbols]

    def decode_completion(self, ids: list[int]) -> list[str]:
        """Symbols before the first EOS (padding and specials after it dropped)."""
        out = []
        for i in ids:
            if i == self.eos or i == self.pad:
                break
            out.append(self.tokens[i])
        return out


class TokenizerVocab:
    """:class:`Vocab`'s interface over a Hugging Face tokenizer (for ``model.hf_path``).

    Every task symbol and the separator must be exactly one token of the tokenizer; EOS is the
    tokenizer's, BOS its BOS (or EOS), PAD its PAD (or EOS).
    """

    def __init__(self, task: Task, tokenizer) -> None:
        unk = getattr(tokenizer, "unk_token_id", None)
        self.ids: dict[str, int] = {}
        for sym in [*task.symbols, SEP]:
            tid = tokenizer.convert_tokens_to_ids(sym)
            if tid is None or (unk is not None and tid == unk):
                raise ConfigError(f"Task symbol {sym!r} is not a single token of the tokenizer at "
                                  f"model.hf_path; pick a task alphabet the tokenizer has tokens for.")
            self.ids[sym] = tid
        if tokenizer.eos_token_id is None:
            raise ConfigError("The tokenizer at model.hf_path has no EOS token; completions could not end.")
        self.eos = tokenizer.eos_token_id
        self.bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.sep = self.ids[SEP]
        self.symbol_of = {i: s for s, i in self.ids.items()}
        self.size = len(tokenizer)

    def __len__(self) -> int:
        return self.size

    def encode(self, symbols: list[str]) -> list[int]:
        return [self.ids[s] for s in symbols]

    def decode_completion(self, ids: list[int]) -> list[str]:
        out = []
        for i in ids:
            if i == self.eos or i == self.pad:
                break
            out.append(self.symbol_of.get(i, "\ufffd"))  # a token outside the task: always wrong
        return out
