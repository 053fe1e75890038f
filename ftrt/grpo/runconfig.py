"""The run's configuration beside its checkpoints: resuming them under another one is refused
unless asked (``resume=force``).

A GRPO run resumes the newest checkpoint at ``checkpoint.url`` whenever there is one, and the
default URL is a folder in the current directory: a second run there with ``lr=0.01`` would
otherwise go on silently from weights trained with ``lr=0.001``. So rank 0 writes the run's
*training fields* (:func:`training_fields`: every field but those that only say how to run it)
to ``run-config.json`` at the URL when the run starts there or is forced on, and every rank
compares before it resumes: a difference is refused with each field's two values.
"""

from __future__ import annotations

import json
from typing import Any

from ftrt.checkpoint.storage import is_storage_error, list_steps, parse_url, read_bytes, storage_problem, write_bytes
from ftrt.errors import ConfigError
from ftrt.grpo.config import GRPOConfig

FILE = "run-config.json"
"""Beside the step folders at ``checkpoint.url``."""

HOW_TO_RUN = ("steps", "threads", "metrics_path", "progress", "resume", "checkpoint", "rollout.request_timeout",
              "rollout.wait_timeout", "rollout.push_timeout", "rollout.etcd", "rollout.job_id")
"""Fields (or sections) a resumed run may change: how long, where its files go, how it checkpoints
and reaches its fleet; not what it trains."""


def training_fields(cfg: GRPOConfig) -> dict[str, Any]:
    """The fields that decide what the run trains, flattened to dotted names (JSON values)."""
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if any(name == h or name.startswith(f"{h}.") for h in HOW_TO_RUN):
                continue
            if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
                walk(value, f"{name}.")
            else:
                flat[name] = value

    walk(cfg.model_dump(mode="json"), "")
    return flat


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each training field whose value differs, as ``name: <saved> in the checkpoints, <now> now``."""
    return [f"{name}: {saved.get(name, '(unset)')!r} in the checkpoints, {now.get(name, '(unset)')!r} now"
            for name in sorted(set(saved) | set(now)) if saved.get(name) != now.get(name)]


def _location(cfg: GRPOConfig):
    return parse_url(cfg.checkpoint.url, cfg.checkpoint.storage_options)


def saved_fields(cfg: GRPOConfig) -> dict[str, Any] | None:
    """The training fields recorded at ``checkpoint.url``, or None when none are."""
    loc = _location(cfg)
    try:
        raw = read_bytes(loc, loc.path(FILE))
    except FileNotFoundError:
        return None
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_problem(cfg.checkpoint.url, exc) from None
        raise
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("fields"), dict):
        raise ConfigError(f"{loc.url_of(FILE)} is not a run configuration written by ftrt (JSON with 'fields'): "
                          "remove it, or give another checkpoint.url.")
    return body["fields"]


def check(cfg: GRPOConfig, has_checkpoint: bool) -> list[str]:
    """Refuse to resume a checkpoint at ``checkpoint.url`` written under other training fields,
    naming each difference (:class:`~ftrt.errors.ConfigError`), unless ``resume=force``; return the
    differences (empty when none, or nothing to compare)."""
    if not has_checkpoint:
        return []
    saved = saved_fields(cfg)
    found = differences(saved, training_fields(cfg)) if saved is not None else []
    if found and cfg.resume != "force":
        raise ConfigError(f"checkpoint.url={cfg.checkpoint.url} holds a run with another configuration, which this "
                          f"run would resume: {'; '.join(found)}. Give another checkpoint.url for a new run, or "
                          "resume=force to go on from those checkpoints with this configuration.")
    return found


def record(cfg: GRPOConfig) -> None:
    """Write this run's training fields to ``checkpoint.url`` (rank 0, when it starts there or is forced on)."""
    loc = _location(cfg)
    if loc.is_local:
        loc.fs.makedirs(loc.root, exist_ok=True)
    write_bytes(loc, loc.path(FILE), json.dumps({"fields": training_fields(cfg)}, indent=1, sort_keys=True).encode())


def check_before_start(cfg: GRPOConfig) -> None:
    """:func:`check` against what ``checkpoint.url`` holds now (every rank of ``ftrt launch -m ftrt.grpo``
    before it builds anything; the Ray driver before it starts its group)."""
    check(cfg, bool(list_steps(parse_url(cfg.checkpoint.url, cfg.checkpoint.storage_options))))


def record_once_started(cfg: GRPOConfig) -> None:
    """Write this run's training fields beside its checkpoints when none are there or other ones are
    (``resume=force`` let them pass, which is said here), once the run knows where it starts."""
    saved, now = saved_fields(cfg), training_fields(cfg)
    if saved == now:
        return
    if saved is not None:
        print(f"[ftrt.grpo] resume=force: going on from checkpoints written with another configuration: "
              f"{'; '.join(differences(saved, now))}", flush=True)
    record(cfg)
