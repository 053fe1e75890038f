"""The policy spec: what a rollout server needs to sample for a job, published by the trainer.

Rank 0 writes it to ``/ftrt/<job>/rollout/spec`` before its first push; servers build their
engine from it. It is JSON, checked field by field (a pydantic model) before anything is built
from it: etcd is not trusted to hold only what the trainer wrote.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field, ValidationError

from ftrt.errors import ConfigError
from ftrt.policy.config import ModelConfig, Strict, TaskConfig, describe


class PolicySpec(Strict):
    """The fields of a trainer's config that decide what a sample is."""

    seed: int = Field(ge=0)
    group_size: int = Field(ge=2)
    temperature: float = Field(gt=0, le=10)
    max_new_tokens: int = Field(ge=0)
    threads: int = Field(1, ge=1, le=256)
    model: ModelConfig
    task: TaskConfig

    @classmethod
    def of(cls, cfg) -> "PolicySpec":
        """The spec of a trainer's config (:class:`ftrt.grpo.config.GRPOConfig`, or anything with
        its seed, group_size, temperature, max_new_tokens, threads, model and task fields)."""
        return cls(seed=cfg.seed, group_size=cfg.group_size, temperature=cfg.temperature,
                   max_new_tokens=cfg.max_new_tokens, threads=cfg.threads, model=cfg.model, task=cfg.task)

    def encode(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()[:16]


def decode_spec(raw: bytes, where: str) -> PolicySpec:
    """The spec stored at ``where``; a ConfigError naming what is wrong if it is not one."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConfigError(f"The rollout spec at {where} is not JSON; the trainer rewrites it when it starts.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"The rollout spec at {where} is not a JSON object.")
    try:
        return PolicySpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"The rollout spec at {where} is invalid: {describe(exc)}") from None
