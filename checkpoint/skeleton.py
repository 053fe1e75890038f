"""The non-tensor part of a state dict as plain JSON: what a memory checkpoint keeps beside its
arena, and what a peer's replica carries. Never a pickle.

A memory checkpoint's index travels between nodes (``PutReplica``) and is read back by a restore,
so anything in it is input from outside the process. Unpickling it would run whatever code the
sender chose; this encoding can only ever produce the values below.

The encoding of a state dict whose tensors were taken out (:func:`encode`):

- ``None``, ``bool``, ``int``, ``float``, ``str``: themselves;
- a list: a JSON array of its encoded items;
- a tuple: ``{"tuple": [items]}``;
- a dict: ``{"dict": [[key, value], ...]}`` (keys encoded like values, so ``int`` keys such as an
  optimizer's parameter ids stay ints);
- a tensor: ``{"tensor": path}``, the tensor's key in the arena.

Anything else in a state dict (a ``torch.dtype``, a user's object) cannot be kept in the memory
tier: :func:`encode` raises :class:`Unencodable` naming where it is and what to do.
:func:`decode` accepts exactly this encoding and raises :class:`BadSkeleton` for anything else.
"""

from __future__ import annotations

from typing import Any, Callable

MAX_DEPTH = 200
"""Deepest nesting :func:`decode` follows (a state dict is a few levels deep)."""


class Unencodable(TypeError):
    """A state dict holds a value the memory tier cannot describe without pickle."""


class BadSkeleton(ValueError):
    """An encoded skeleton that this module did not write (malformed, or from an older ftrt)."""


_SCALARS = (type(None), bool, int, float, str)


def encode(x: Any, is_tensor: Callable[[Any], bool], prefix: str = "") -> tuple[Any, dict[str, Any]]:
    """``x`` as JSON-ready values, and its tensors by path (``/key/0/...``, their arena keys)."""
    tensors: dict[str, Any] = {}

    def walk(v: Any, path: str) -> Any:
        if is_tensor(v):
            tensors[path] = v
            return {"tensor": path}
        if isinstance(v, _SCALARS):
            return v
        if isinstance(v, list):
            return [walk(item, f"{path}/{i}") for i, item in enumerate(v)]
        if isinstance(v, tuple):
            return {"tuple": [walk(item, f"{path}/{i}") for i, item in enumerate(v)]}
        if isinstance(v, dict):
            if any(is_tensor(k) for k in v):
                raise Unencodable(f"The state's entry {path or '/'!r} is a dict with a tensor as a key, which "
                                  "the memory checkpoint tier cannot keep.")
            return {"dict": [[walk(k, f"{path}/<key>"), walk(item, f"{path}/{k}")] for k, item in v.items()]}
        raise Unencodable(
            f"The state's entry {path or '/'!r} is a {type(v).__module__}.{type(v).__qualname__}, which the memory "
            "checkpoint tier cannot keep: it holds tensors and plain values only (None, bool, int, float, str, "
            "list, tuple, dict). Store it as one of those or as a tensor, or turn the memory tier off "
            "(checkpoint.memory_interval=0)."
        )

    return walk(x, prefix), tensors


def decode(obj: Any, tensor: Callable[[str], Any], depth: int = 0) -> Any:
    """The value :func:`encode` described, with ``tensor(path)`` for each tensor. Raises
    :class:`BadSkeleton` for anything :func:`encode` cannot have written."""
    if depth > MAX_DEPTH:
        raise BadSkeleton(f"the skeleton nests deeper than {MAX_DEPTH} levels")
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, list):
        return [decode(v, tensor, depth + 1) for v in obj]
    if isinstance(obj, dict) and len(obj) == 1:
        (kind, body), = obj.items()
        if kind == "tensor" and isinstance(body, str):
            return tensor(body)
        if kind == "tuple" and isinstance(body, list):
            return tuple(decode(v, tensor, depth + 1) for v in body)
        if kind == "dict" and isinstance(body, list):
            out = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise BadSkeleton("a dict entry of the skeleton is not a [key, value] pair")
                key = decode(pair[0], _no_tensor, depth + 1)
                try:
                    out[key] = decode(pair[1], tensor, depth + 1)
                except TypeError:  # an unhashable key (a list)
                    raise BadSkeleton(f"a dict key of the skeleton is a {type(key).__name__}") from None
            return out
    raise BadSkeleton(f"the skeleton holds {str(obj)[:80]!r}, which is not part of ftrt's encoding")


def _no_tensor(path: str) -> Any:
    raise BadSkeleton(f"a dict key of the skeleton is a tensor ({path!r})")


def tensor_paths(obj: Any) -> list[str]:
    """Every tensor path named in an encoded skeleton (raises :class:`BadSkeleton` if malformed)."""
    found: list[str] = []

    def take(path: str) -> None:
        found.append(path)

    decode(obj, take)
    return found


__all__ = ["BadSkeleton", "MAX_DEPTH", "Unencodable", "decode", "encode", "tensor_paths"]
