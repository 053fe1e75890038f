"""Turning a user's ``state`` into the dict DCP saves, and loading DCP's result back into it.

``state`` maps names to modules, optimizers, other objects with ``state_dict()`` /
``load_state_dict()``, tensors (also DTensors) and plain Python values. Modules and optimizers go
through DCP's ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict``, which give
sharded (DTensor) entries for FSDP2, strip DDP's prefixes, key optimizer state by parameter name
(so it reshards) and initialise an optimizer that has not stepped yet, so a fresh job can restore.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ftrt.errors import ConfigError


def _owner(opt: torch.optim.Optimizer, key: str, modules: dict[str, nn.Module]) -> nn.Module:
    params = {id(p) for group in opt.param_groups for p in group["params"]}
    for module in modules.values():
        if params <= {id(p) for p in module.parameters()}:
            return module
    raise ConfigError(
        f"The optimizer under {key!r} needs the model whose parameters it updates in the same "
        f"state dict (found modules: {', '.join(modules) or 'none'}); add it, e.g. "
        "{'model': model, 'optim': optimizer}."
    )


def to_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """The dict DCP saves (or loads into): references to the live tensors, no copies."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(state, dict):
        raise ConfigError(f"A checkpoint state must be a dict of named entries, got {type(state).__name__}.")
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ConfigError(f"Checkpoint state keys must be strings, got {key!r}.")
        if isinstance(value, nn.Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = get_optimizer_state_dict(_owner(value, key, modules), value)
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def apply(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put what DCP loaded (into a :func:`to_dcp` dict) back into the user's objects, in place."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            set_model_state_dict(value, loaded[key])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner(value, key, modules), value, loaded[key])
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            value.load_state_dict(loaded[key])
        elif isinstance(value, torch.Tensor):
            pass  # DCP loaded into the tensor itself
        else:
            state[key] = loaded[key]
