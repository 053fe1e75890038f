"""GRPO run configuration: a pydantic model, loadable from YAML, overridable with ``KEY=VALUE``.

Every field is documented (``python -m ftrt.grpo --help-config`` prints them). Bad values are
rejected with :class:`ftrt.errors.ConfigError` naming the dotted field, the value and the rule.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ftrt.errors import ConfigError
from ftrt.policy.config import ModelConfig, Strict, TaskConfig, describe  # noqa: F401 - describe: part of this module's API


class CheckpointConfig(Strict):
    """Where and how often the run checkpoints (ftrt.checkpoint.Checkpointer)."""

    url: str | None = Field("grpo-checkpoints", description="checkpoint URL (path, file://, s3://, "
                            "memory://); a run resumes from the newest checkpoint there; null: none")
    storage_options: dict[str, Any] | None = Field(None, description="fsspec options for the URL "
                                                   "(s3: key, secret, client_kwargs.endpoint_url, ...)")
    interval: Union[Literal["auto"], int] = Field(
        "auto", description="steps between checkpoints written to storage, or auto: the Young/Daly "
        "interval from the measured save cost and the MTBF (docs/design.md, 'Checkpoint cadence')")
    keep: int = Field(2, ge=1, description="committed checkpoints kept in storage")
    memory_interval: Union[Literal["auto"], int] = Field(
        "auto", description="steps between in-memory checkpoints under ftrt launch (0: none; a crash "
        "loses at most this many steps), or auto: chosen like interval")
    mtbf: float | None = Field(None, gt=0, description="mean seconds between faults (a node or a "
                               "worker lost) that auto plans for (default: ftrt launch --mtbf, else "
                               "observed from the job's faults, else one hour); the storage tier plans "
                               "for storage_mtbf instead where memory checkpoints recover a node's loss")
    storage_mtbf: float | None = Field(None, gt=0, description="mean seconds between losses of every "
                                       "in-memory copy of the state (several nodes at once, the whole "
                                       "job), which storage's auto plans for under ftrt launch with a "
                                       "memory tier on 2 or more nodes (default: one hour, or the job's "
                                       "age once longer)")
    max_interval_s: float = Field(1800.0, gt=0, description="auto never lets more than this many "
                                  "seconds of training go without a storage checkpoint")
    memory_max_interval_s: float = Field(300.0, gt=0, description="auto never lets more than this "
                                         "many seconds of training go without a memory checkpoint")

    @field_validator("interval", "memory_interval", mode="before")
    @classmethod
    def _interval(cls, v: Any, info: ValidationInfo) -> Any:
        least = 1 if info.field_name == "interval" else 0
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= least):
            return v
        raise ValueError(f"give auto or a whole number of steps >= {least}")


class RolloutConfig(Strict):
    """Where completions come from: sampled inside each trainer rank (local) or by a separate
    fleet of rollout servers (``ftrt rollout serve``; docs/rollout.md)."""

    mode: Literal["local", "fleet"] = Field("local", description="local: each rank samples its own "
                                            "prompts; fleet: rank 0 dispatches every prompt group to the "
                                            "job's rollout servers and pushes them each new weight version")
    max_off_policy_steps: int = Field(0, ge=0, le=8, description="fleet: step s trains on samples made "
                                      "with exactly the weights of version max(0, s - K); K >= 1 overlaps "
                                      "generation of later steps with training")
    request_timeout: float = Field(30.0, gt=0, description="fleet: seconds a server may take for one "
                                   "prompt group before the group goes to another server")
    wait_timeout: float = Field(120.0, gt=0, description="fleet: seconds without a live server holding "
                                "the current weights before the run fails with an error")
    push_timeout: float = Field(60.0, gt=0, description="fleet: seconds one server may take to take one "
                                "weight push; a server that misses it serves nothing until a good push")
    etcd: str | None = Field(None, description="fleet: etcd endpoints (default: the job's, under ftrt "
                             "launch)")
    job_id: str | None = Field(None, description="fleet: the job id the servers serve (default: the "
                               "job's, under ftrt launch)")


class GRPOConfig(Strict):
    """One GRPO run. Defaults learn the default task on 2 CPU ranks in a few minutes."""

    seed: int = Field(0, ge=0, description="seeds the model init, the prompts and every sample")
    steps: int = Field(250, ge=1, description="optimizer steps to train")
    prompts_per_step: int = Field(32, ge=1, description="prompts per step, global: the same at "
                                  "any world size (ranks split them)")
    group_size: int = Field(16, ge=2, description="completions per prompt (G)")
    lr: float = Field(1e-3, gt=0, le=1, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm (0: no clipping)")
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip: ratio >= 1 - clip_eps_low")
    clip_eps_high: float = Field(0.28, ge=0, description="PPO clip: ratio <= 1 + clip_eps_high")
    kl_beta: float = Field(0.0, ge=0, description="weight of the k3 KL to the frozen initial "
                           "policy (0: no reference model)")
    loss_agg: Literal["token_mean", "seq_mean", "dr_grpo"] = Field(
        "token_mean", description="token_mean: over all tokens; seq_mean: per sequence then over "
        "sequences; dr_grpo: token sum over (sequences x max_new_tokens)")
    adv_std_norm: bool = Field(True, description="divide group advantages by the group's std "
                               "(Dr. GRPO turns this off)")
    ppo_epochs: int = Field(1, ge=1, le=16, description="optimizer passes over each rollout")
    max_new_tokens: int = Field(0, ge=0, description="completion length cap; a completion ends at "
                                "EOS or here (0: the task's answer length)")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature")
    threads: int = Field(1, ge=1, description="torch threads per rank (fixed, so results are "
                         "reproducible)")
    metrics_path: str | None = Field("grpo-metrics.jsonl", description="rank 0 appends one JSON "
                                     "line per step here (none: no file)")
    resume: Literal["auto", "force"] = Field("auto", description="auto: resume the newest checkpoint at "
                                             "checkpoint.url only if it was written with the same training fields "
                                             "(steps, files, checkpoint and fleet settings may change), else refuse "
                                             "and say what differs; force: resume it anyway")
    progress: Literal["auto", "bar", "none"] = Field("auto", description="progress bar: auto shows "
                                                     "it on a terminal")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @property
    def steps_stand_alone(self) -> bool:
        """One optimizer pass a step and completions sampled by the ranks themselves: between two
        steps every rank holds a whole step, and a step's work depends only on the weights and its
        prompts (what in-place recovery keeps across a lost peer: ftrt.grpo.salvage, and the memory
        cadence behind the live ranks)."""
        return self.ppo_epochs == 1 and self.rollout.mode == "local"

    @model_validator(mode="after")
    def _off_policy_needs_fleet(self) -> "GRPOConfig":
        if self.rollout.max_off_policy_steps and self.rollout.mode != "fleet":
            raise ValueError(f"Config field 'rollout.max_off_policy_steps' = {self.rollout.max_off_policy_steps} "
                             "needs rollout.mode=fleet (local ranks always sample with the current weights)")
        return self


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"Config override {key}: {p} is not a section.")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """Build a config from an optional YAML file and ``KEY=VALUE`` overrides (values parsed as YAML)."""
    data: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"Cannot read the config file {path}: {exc.strerror}.") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"The config file {path} is not valid YAML: {exc}.") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"The config file {path} must hold a mapping of fields, not {type(loaded).__name__}.")
        data = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"Override {item!r} is not KEY=VALUE (e.g. steps=100 or checkpoint.url=/tmp/ck).")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        if key in ("task.name", "rollout.etcd", "rollout.job_id") or key.endswith("url") or key.endswith("path"):
            value = raw if raw not in ("null", "none", "None") else None
        _set_dotted(data, key, value)
    try:
        return GRPOConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None


def help_text() -> str:
    """Every field with its default and description (for ``--help-config``)."""
    out = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = f.default if f.default_factory is None else f.default_factory()
            out.append(f"  {prefix}{name} = {default!r}\n      {f.description}")

    walk(GRPOConfig, "")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A command's config arguments: ``--config FILE``, ``--help-config`` and ``KEY=VALUE`` overrides
    (``python -m ftrt.grpo``, ``python -m ftrt.grpo.ray``)."""
    p.add_argument("--config", help="YAML file with config fields")
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. checkpoint.interval=5")
