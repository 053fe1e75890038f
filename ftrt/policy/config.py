"""The policy's configuration: the model and the task (pydantic models, every field documented).

Shared by the GRPO trainer's config (:mod:`ftrt.grpo.config`) and the policy spec rollout servers
build from (:mod:`ftrt.policy.spec`). Bad values are rejected with the dotted field, the value and
the rule (:func:`describe`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    """A config model that refuses unknown fields and checks assignments too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    """The policy: the built-in tiny causal transformer, or a local Hugging Face causal LM."""

    d_model: int = Field(96, ge=8, le=4096, description="hidden size of the built-in transformer")
    n_layers: int = Field(2, ge=1, le=64, description="transformer blocks")
    n_heads: int = Field(4, ge=1, le=64, description="attention heads (must divide d_model)")
    hf_path: str | None = Field(None, description="local path of a Hugging Face causal LM and its "
                                "tokenizer to train instead (needs the 'hf' extra; every task symbol "
                                "must be one token)")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        return self


class TaskConfig(Strict):
    """The task: prompts and a verifiable reward in [0, 1] (see ftrt.policy.tasks)."""

    name: str = Field("reverse", description="registered task name (built in: reverse, add)")
    params: dict[str, Any] = Field(default_factory=lambda: {"length": 6, "alphabet": 16},
                                   description="the task's own parameters (reverse: length, "
                                   "alphabet; add: digits)")


def describe(exc: ValidationError) -> str:
    """One sentence per problem: the dotted field, the value given and what is allowed."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        given = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(f"Unknown config field {field!r}; see python -m ftrt.grpo --help-config.")
        elif not err["loc"]:  # a rule across fields: its message names them
            lines.append(f"{msg}.")
        else:
            lines.append(f"Config field {field!r} = {given!r} is invalid: {msg}.")
    return " ".join(lines)
