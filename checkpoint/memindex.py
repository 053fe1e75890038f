"""A memory checkpoint's index, checked: what makes an index from a peer safe to restore from.

An index (``current.json`` beside a rank's arena, :mod:`ftrt.checkpoint.memtier`) says where each
tensor lies in the arena and what the state around the tensors is. Replicas arrive from other
nodes (``PutReplica``), so before one is stored or restored, :func:`check_index` makes sure it is
exactly what :meth:`Arena.commit` writes, consistent in itself: integer fields in range, every
entry inside the arena and inside its tensor, a known dtype, a skeleton in ftrt's JSON encoding
(:mod:`ftrt.checkpoint.skeleton`) that names only the index's entries.

:class:`MemIndex` and :class:`IndexEntry` type what an index holds; a dict read from a file or
received from a peer is one only once :func:`check_index` has accepted it.

Without torch (the agent checks replicas and does not import it).
"""

from __future__ import annotations

import math
from typing import Any, TypedDict, cast

from ftrt.checkpoint import skeleton as skel

ITEMSIZE = {
    "torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2,
    "torch.complex128": 16, "torch.complex64": 8, "torch.complex32": 4,
    "torch.int64": 8, "torch.int32": 4, "torch.int16": 2, "torch.int8": 1,
    "torch.uint64": 8, "torch.uint32": 4, "torch.uint16": 2, "torch.uint8": 1, "torch.bool": 1,
    "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1, "torch.float8_e4m3fnuz": 1, "torch.float8_e5m2fnuz": 1,
}
"""Bytes per element of each dtype an index may name (by ``str(dtype)``)."""


MAX_SLOTS = 64
"""More arena slots than any staging configuration uses."""


class IndexEntry(TypedDict):
    """Where one tensor of a rank's state lies in its arena, and which part of the tensor it is."""

    key: str
    """The tensor's path in the state (:func:`ftrt.checkpoint.memtier.flatten`)."""
    dtype: str
    """``str(dtype)``, one of :data:`ITEMSIZE`."""
    offset: int
    """Its first byte in the arena."""
    nbytes: int
    """Its size in the arena (``prod(local_shape) * itemsize``)."""
    local_shape: list[int]
    """The shape of this rank's chunk."""
    global_shape: list[int]
    """The shape of the whole tensor (the chunk's, for a plain tensor)."""
    global_offset: list[int]
    """Where the chunk starts in the whole tensor (zeros for a plain tensor)."""


class MemIndex(TypedDict):
    """One rank's memory checkpoint (``current.json``/``previous.json``), as
    :meth:`ftrt.checkpoint.memtier.Arena.commit` writes it."""

    step: int
    round: int
    """The rendezvous round that saved it."""
    rank: int
    """The rank that saved it, in a world of ``world``."""
    world: int
    slot: int
    """The arena slot (``slot-<k>.bin``) its tensors are in."""
    size: int
    """The bytes of the arena it uses."""
    entries: list[IndexEntry]
    skeleton: dict[str, Any]
    """The state around the tensors, in ftrt's JSON encoding (:mod:`ftrt.checkpoint.skeleton`)."""


class BadIndex(ValueError):
    """A memory checkpoint index that ftrt did not write as it reads (malformed, inconsistent, or
    from an older ftrt): never stored or restored."""


def _int(index: dict, field: str, low: int = 0) -> int:
    v = index.get(field)
    if type(v) is not int or v < low:
        raise BadIndex(f"{field} = {str(v)[:40]!r} is not an integer >= {low}")
    return v


def _ints(e: dict, field: str, n: int | None = None) -> list[int]:
    v = e.get(field)
    if not isinstance(v, list) or any(type(x) is not int or x < 0 for x in v) or (n is not None and len(v) != n):
        raise BadIndex(f"entry {str(e.get('key'))[:60]!r}: {field} is not a list of integers >= 0"
                       + (f" of length {n}" if n is not None else ""))
    return v


def check_index(index: Any) -> MemIndex:
    """``index`` if it is a memory checkpoint index as :meth:`Arena.commit` writes it and
    consistent in itself (ranks, slots, every entry inside the arena and inside its tensor,
    dtypes, a skeleton in ftrt's JSON encoding naming only its entries), else :class:`BadIndex`.

    Indexes arrive from peers (``PutReplica``): this is what makes one safe to restore from.
    """
    if not isinstance(index, dict):
        raise BadIndex("the index is not a JSON object")
    _int(index, "step")
    _int(index, "round")
    world = _int(index, "world", 1)
    if _int(index, "rank") >= world:
        raise BadIndex(f"rank {index['rank']} is outside a world of {world}")
    if _int(index, "slot") >= MAX_SLOTS:
        raise BadIndex(f"slot {index['slot']} is not below {MAX_SLOTS}")
    size = _int(index, "size")
    entries = index.get("entries")
    if not isinstance(entries, list):
        raise BadIndex("entries is not a list")
    keys = set()
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("key"), str) or e["key"] in keys:
            raise BadIndex("an entry has no key, or a key used twice")
        keys.add(e["key"])
        itemsize = ITEMSIZE.get(e.get("dtype")) if isinstance(e.get("dtype"), str) else None
        if itemsize is None:
            raise BadIndex(f"entry {e['key'][:60]!r}: dtype {str(e.get('dtype'))[:40]!r} is not a torch dtype")
        offset, nbytes = _int(e, "offset"), _int(e, "nbytes")
        local = _ints(e, "local_shape")
        shape, at = _ints(e, "global_shape", len(local)), _ints(e, "global_offset", len(local))
        if nbytes != math.prod(local) * itemsize or offset + nbytes > size:
            raise BadIndex(f"entry {e['key'][:60]!r} does not fit its arena of {size} bytes")
        if any(o + n > g for o, n, g in zip(at, local, shape)):
            raise BadIndex(f"entry {e['key'][:60]!r} lies outside its tensor's shape")
    top = index.get("skeleton")
    if not (isinstance(top, dict) and isinstance(top.get("dict"), list) and len(top) == 1):
        raise BadIndex(f"the skeleton {str(top)[:40]!r} is not ftrt's JSON encoding of a state dict "
                       "(an index written by ftrt before 2026-12-03 held a pickle there)")
    try:
        named = skel.tensor_paths(top)
    except skel.BadSkeleton as exc:
        raise BadIndex(str(exc)) from None
    if not set(named) <= keys:
        raise BadIndex("the skeleton names tensors the index has no entry for")
    return cast(MemIndex, index)


__all__ = ["BadIndex", "ITEMSIZE", "IndexEntry", "MemIndex", "check_index"]
