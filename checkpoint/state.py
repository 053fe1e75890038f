"""Turning a user's ``state`` into the dict DCP saves, and loading DCP's result back into it.

``state`` maps names to modules, optimizers, other objects with ``state_dict()`` /
``load_state_dict()``, tensors (also DTensors) and plain Python values. Modules and optimizers go
through DCP's ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict``, which give
sharded (DTensor) entries for FSDP2, strip DDP's prefixes, key optimizer state by parameter name
(so it reshards) and initialise an optimizer that has not stepped yet, so a fresh job can restore.
"""

from __future__ import annotations

from typing import Any, Callable

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

    return _convert(state, get_model_state_dict, lambda owner, opt: get_optimizer_state_dict(owner(), opt))


def _convert(state: dict[str, Any], model_sd: Callable[[nn.Module], dict],
             optim_sd: Callable[[Callable[[], nn.Module], torch.optim.Optimizer], dict]) -> dict[str, Any]:
    """:func:`to_dcp` with the module and optimizer state dicts made by ``model_sd`` / ``optim_sd``.

    ``optim_sd`` gets the optimizer's module as a callable: finding it costs a walk over every
    parameter, which only DCP's own function needs.
    """
    if not isinstance(state, dict):
        raise ConfigError(f"A checkpoint state must be a dict of named entries, got {type(state).__name__}.")
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ConfigError(f"Checkpoint state keys must be strings, got {key!r}.")
        if isinstance(value, nn.Module):
            out[key] = model_sd(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = optim_sd(lambda value=value, key=key: _owner(value, key, modules), value)
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


class StateDicts:
    """:func:`to_dcp` for every save of one checkpointer, fast for plain modules and their optimizers.

    DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` recompute every parameter's name
    on each call (milliseconds of Python per save, paid on the training thread at every memory
    checkpoint). For a module that is not sharded, their result is ``module.state_dict()`` and
    ``optimizer.state_dict()`` with keys renamed to parameter names. The first save (and any save
    after the structure changed: other keys, new optimizer state) takes DCP's way and checks the
    fast result against it, tensor by tensor (same storage, same shape); while the structure stays
    the same, later saves take the fast way. A module that does not pass the check (FSDP2's
    DTensors, hooks that change tensors) always takes DCP's way.
    """

    def __init__(self) -> None:
        self._models: dict[int, tuple[tuple[str, ...], tuple[str, ...]] | None] = {}
        self._optims: dict[int, tuple[tuple, list[str]] | None] = {}

    def to_dcp(self, state: dict[str, Any]) -> dict[str, Any]:
        """The same dict as :func:`to_dcp` (references to the live tensors)."""
        return _convert(state, self._model, self._optim)

    def _model(self, module: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        entry = self._models.get(id(module), ())
        if entry is None:
            return get_model_state_dict(module)
        fast = module.state_dict()
        keys = tuple(fast)
        if entry and entry[0] == keys:
            return dict(zip(entry[1], fast.values()))
        slow = get_model_state_dict(module)
        ok = len(slow) == len(fast) and all(_same(a, b) for a, b in zip(fast.values(), slow.values()))
        self._models[id(module)] = (keys, tuple(slow)) if ok else None
        return slow

    def _optim(self, owner: Callable[[], nn.Module], opt: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        entry = self._optims.get(id(opt), ())
        if entry is None:
            return get_optimizer_state_dict(owner(), opt)
        fast = opt.state_dict()
        if entry and entry[0] == _optim_shape(fast):
            return _renamed(fast, entry[1])
        slow = get_optimizer_state_dict(owner(), opt)
        fast = opt.state_dict()  # DCP initialises the state of an optimizer that has not stepped
        ints = [i for g in fast["param_groups"] for i in g["params"]]
        names = [n for g in slow.get("param_groups", []) for n in g["params"]]
        ok = len(ints) == len(names) and ints == list(range(len(ints))) and _same_optim(_renamed(fast, names), slow)
        self._optims[id(opt)] = (_optim_shape(fast), names) if ok else None
        return slow


def _optim_shape(sd: dict[str, Any]) -> tuple:
    """What must stay the same for a cached renaming to hold: group sizes and per-parameter state keys."""
    return (tuple(len(g["params"]) for g in sd["param_groups"]),
            tuple((i, tuple(entry)) for i, entry in sd["state"].items()))


def _renamed(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def _same(a: Any, b: Any) -> bool:
    """The same plain tensor (storage, offset, shape) or an equal plain value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (type(a) is torch.Tensor and type(b) is torch.Tensor and a.data_ptr() == b.data_ptr()
                and a.shape == b.shape and a.dtype == b.dtype)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot compare are not "the same"
        return False


def _same_optim(fast: dict[str, Any], slow: dict[str, Any]) -> bool:
    if set(slow) != {"state", "param_groups"} or set(fast["state"]) != set(slow["state"]):
        return False
    for name, entry in fast["state"].items():
        other = slow["state"][name]
        if set(entry) != set(other) or not all(_same(entry[k], other[k]) for k in entry):
            return False
    groups = slow["param_groups"]
    return len(groups) == len(fast["param_groups"]) and all(
        set(g) == set(h) and all(_same(g[k], h[k]) for k in g) for g, h in zip(fast["param_groups"], groups))


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
