"""The memory tiers: each rank's staged copy in a shared-memory arena its node's agent keeps.

Layout under the node's memory directory (``$FTRT_MEM_DIR``, created by the agent on tmpfs and
removed when it exits)::

    own/rank-<r>/slot-<k>.bin        arenas: every tensor of rank r's state, 64-byte aligned
    own/rank-<r>/current.json        the newest complete memory checkpoint of rank r (index)
    own/rank-<r>/previous.json       the one before it, valid until its slot is reused
    replicas/<node>/rank-<r>/...     the same, received from a peer node's agent

Staging writes straight into an arena slot (the staging buffers *are* the arena), then
``current.json`` is replaced atomically: a worker that dies mid-copy leaves the previous complete
checkpoint in place. Slots rotate (the checkpointer stages into any slot but the current one, and
one may be held by a save still going to storage), so the newest complete one is never overwritten.

An index records, per tensor, its place in the arena and, for DTensors, the global shape and the
offset of this rank's chunk. Restore therefore needs no DCP: for every tensor of the new world it
copies the overlapping regions of the old chunks (any world size, for ``Shard``/``Replicate``
placements), taking arenas from the local node where present and moving the others between ranks
with a broadcast on the checkpoint's process group.
"""

from __future__ import annotations

import json
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from ftrt.checkpoint import skeleton as skel
from ftrt.checkpoint.memfiles import index_slots, publish_index, withdraw
from ftrt.checkpoint.memindex import ITEMSIZE, BadIndex, IndexEntry, MemIndex, check_index
from ftrt.checkpoint.staging import _is_dtensor
from ftrt.privatefiles import private_dir, private_file

log = logging.getLogger(__name__)

ALIGN = 64


class Unsupported(Exception):
    """A tensor layout the memory tier cannot reshard (the storage tier is used instead)."""


class HeldIndex(MemIndex):
    """A memory checkpoint a node holds (:func:`scan`): its checked index and its arena file."""

    file: str
    """The arena slot's file, a path on the node that holds it."""


class Choice(NamedTuple):
    """The memory checkpoint a restore takes (:func:`choose`)."""

    step: int
    round: int
    world: int
    """The world size that saved it (its old ranks are 0 .. world - 1)."""
    holders: dict[int, int]
    """Old rank held -> the lowest new rank whose node holds it."""


_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype) and str(v) in ITEMSIZE}
"""The dtypes an index may name, by ``str`` (``"torch.float32"``): no other attribute of torch."""


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise BadIndex(f"dtype {str(name)[:40]!r} is not a torch dtype") from None


def _region(t: Any) -> tuple[list[int], list[int], list[int]]:
    """(local shape, global shape, global offset of the local chunk)."""
    if _is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return list(local_shape), list(t.shape), list(offset)
    return list(t.shape), list(t.shape), [0] * t.dim()


def layout(flat: dict[str, Any]) -> tuple[list[IndexEntry], int]:
    """Place every tensor of a flattened state in an arena; return its index entries and the arena size."""
    entries: list[IndexEntry] = []
    pos = 0
    for key, t in flat.items():
        local = t.to_local() if _is_dtensor(t) else t
        local_shape, global_shape, offset = _region(t)
        nbytes = local.numel() * local.element_size()
        entries.append(IndexEntry(key=key, dtype=str(local.dtype), offset=pos, nbytes=nbytes, local_shape=local_shape,
                                  global_shape=global_shape, global_offset=offset))
        pos += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, max(pos, ALIGN)


def flatten(sd: Any, prefix: str = "") -> tuple[dict[str, Any], Any]:
    """Split a state dict into its tensors (by path) and its skeleton: the rest, as JSON
    (:mod:`ftrt.checkpoint.skeleton`; raises :class:`skeleton.Unencodable` for a value it cannot
    describe)."""
    encoded, tensors = skel.encode(sd, lambda v: isinstance(v, torch.Tensor), prefix)
    return tensors, encoded


class Arena:
    """One rank's double-buffered arena in a node's memory directory."""

    def __init__(self, mem_dir: str, rank: int) -> None:
        self.dir = private_dir(Path(mem_dir) / "own" / f"rank-{rank}")
        self.rank = rank
        self._maps: dict[int, torch.Tensor] = {}
        self._sizes: dict[int, int] = {}
        self._views: dict[int, tuple[tuple, torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._indexes = index_slots(self.dir)
        """The slot ``current.json`` and ``previous.json`` name. A rank's directory has one writer,
        its worker, so from here on this arena knows them without reading the files at every save."""

    def current_slot(self) -> int | None:
        """The slot of the rank's current memory checkpoint (None: there is none)."""
        return self._indexes.get("current.json")

    def buffers(self, slot: int, entries: list[IndexEntry], size: int) -> dict[str, torch.Tensor]:
        """Tensors viewing slot ``slot`` of the arena, laid out as ``entries``.

        The checkpoint that slot held (``previous.json``) stops existing before it is overwritten.
        """
        withdraw(self.dir, [name for name, held in self._indexes.items() if held == slot])
        self._indexes = {name: held for name, held in self._indexes.items() if held != slot}
        if self._sizes.get(slot) != size:
            path = self.dir / f"slot-{slot}.bin"
            with private_file(path) as f:
                f.truncate(size)
            self._maps[slot] = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            self._sizes[slot] = size
        raw = self._maps[slot]
        # The same layout save after save: reuse the slot's views (making them is ~1 ms a save).
        signature = tuple((e["key"], e["dtype"], e["offset"], e["nbytes"], *e["local_shape"]) for e in entries)
        cached = self._views.get(slot)
        if cached is not None and cached[0] == signature and cached[1] is raw:
            return cached[2]
        views = {
            e["key"]: raw[e["offset"]:e["offset"] + e["nbytes"]].view(_dtype(e["dtype"])).view(e["local_shape"])
            for e in entries
        }
        self._views[slot] = (signature, raw, views)
        return views

    def commit(self, *, slot: int, step: int, round_no: int, world: int, entries: list[IndexEntry],
               size: int, skeleton: Any) -> MemIndex:
        """Make ``slot`` the rank's current memory checkpoint (atomic rename)."""
        index: MemIndex = {
            "step": step, "round": round_no, "rank": self.rank, "world": world, "slot": slot,
            "size": size, "entries": entries,
            "skeleton": skeleton,
        }
        publish_index(self.dir, index)
        current = self._indexes.get("current.json")
        self._indexes = {"current.json": slot, **({"previous.json": current} if current is not None else {})}
        return index


def scan(mem_dir: str) -> list[HeldIndex]:
    """Every complete memory checkpoint in a node's directory (own and replicas), with its file.
    An index that does not check out (:func:`check_index`) is skipped with a warning."""
    out: list[HeldIndex] = []
    for current in [*Path(mem_dir).glob("**/current.json"), *Path(mem_dir).glob("**/previous.json")]:
        try:
            index = check_index(json.loads(current.read_text()))
        except OSError:
            continue
        except ValueError as exc:  # BadIndex, or not JSON
            log.warning("ignoring memory checkpoint index %s: %s", current, exc)
            continue
        held = cast(HeldIndex, index)
        held["file"] = str(current.parent / f"slot-{index['slot']}.bin")
        try:
            if os.path.getsize(held["file"]) >= held["size"]:
                out.append(held)
        except OSError:
            pass
    return out


def choose(per_rank: list[list[MemIndex]]) -> Choice | None:
    """Pick the newest (step, round) whose state the new ranks' nodes hold in full.

    ``per_rank[r]`` lists the checkpoints new rank r's node holds. A checkpoint is whole when the
    old ranks held cover every tensor: all old ranks for a sharded state, any one for a replicated
    (data-parallel) state, whose every rank saved every tensor in full. So a peer's replica that
    lags behind only matters where the survivors' own copies do not cover the state. Returns
    (step, round, old world, {old rank held: the lowest new rank whose node holds it}), or None.
    """
    holders: dict[tuple[int, int, int], dict[int, int]] = {}
    indexes: dict[tuple[int, int, int], dict[int, MemIndex]] = {}
    for new_rank, items in enumerate(per_rank):
        for it in items:
            k = (it["step"], it["round"], it["world"])
            holders.setdefault(k, {}).setdefault(it["rank"], new_rank)
            indexes.setdefault(k, {}).setdefault(it["rank"], it)
    whole = [k for k, h in holders.items()
             if (len(h) == k[2] and set(h) == set(range(k[2]))) or _covers(list(indexes[k].values()))]
    if not whole:
        return None
    step, rnd, world = max(whole)
    return Choice(step, rnd, world, holders[(step, rnd, world)])


def describe(per_rank: list[list[MemIndex]]) -> str:
    """What each new rank's node holds, for a log line: ``rank 0: r0@12 r1@11; rank 1: ...``."""
    return "; ".join(f"rank {i}: " + (" ".join(f"r{it['rank']}@{it['step']}" for it in sorted(
        items, key=lambda it: (it["rank"], it["step"]))) or "nothing") for i, items in enumerate(per_rank))


def _covers(held: list[MemIndex]) -> bool:
    """Whether the held ranks' chunks cover every tensor of the saved state.

    Chunks of one tensor (DTensor shards and replicas) are either the same box or disjoint, so
    the distinct boxes cover the tensor exactly when their volumes add up to its volume.
    """
    boxes: dict[str, set[tuple]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for index in held:
        for e in index.get("entries", []):
            boxes.setdefault(e["key"], set()).add((tuple(e["global_offset"]), tuple(e["local_shape"])))
            shapes[e["key"]] = tuple(e["global_shape"])
    if not shapes:
        return False
    for key, shape in shapes.items():
        if sum(math.prod(box[1]) for box in boxes[key]) != math.prod(shape):
            return False
    return True


def _overlap(a_off, a_shape, b_off, b_shape):
    """Slices (into a, into b) of the overlap of two boxes, or None."""
    sa, sb = [], []
    for ao, al, bo, bl in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if lo >= hi:
            return None
        sa.append(slice(lo - ao, hi - ao))
        sb.append(slice(lo - bo, hi - bo))
    return tuple(sa), tuple(sb)


def fill(target_flat: dict[str, Any], old: dict[int, MemIndex], arenas: dict[int, torch.Tensor],
         files: dict[int, str] | None = None) -> None:
    """Copy into every target tensor (in place) the overlapping parts of the old ranks' chunks.

    ``files`` names the arena file behind ``arenas[r]`` where there is one (a mapping of it):
    contiguous parts are then read from the file straight into the target, which is faster than
    copying from the mapping and leaves no mapped pages to tear down.
    """
    by_rank = {r: {e["key"]: e for e in idx["entries"]} for r, idx in old.items()}
    files = files or {}
    copies: list[tuple[torch.Tensor, torch.Tensor, str | None]] = []
    for key, t in target_flat.items():
        local = t.to_local() if _is_dtensor(t) else t
        if _is_dtensor(t):
            for p in t.placements:
                if type(p).__name__ not in ("Shard", "Replicate"):
                    raise Unsupported(f"{key}: placement {p} is not Shard or Replicate")
        local_shape, global_shape, offset = _region(t)
        covered = False
        for r in sorted(old, key=lambda r: (r not in arenas, r)):
            e = by_rank[r].get(key)
            if e is None:
                raise Unsupported(f"{key} is not in the memory checkpoint of old rank {r}")
            if e["global_shape"] != global_shape or e["dtype"] != str(local.dtype):
                raise Unsupported(f"{key}: saved as {e['dtype']}{e['global_shape']}, now {local.dtype}{global_shape}")
            if r not in arenas:
                continue
            ov = _overlap(e["global_offset"], e["local_shape"], offset, local_shape)
            if ov is None:
                continue
            src = arenas[r][e["offset"]:e["offset"] + e["nbytes"]].view(_dtype(e["dtype"])).view(e["local_shape"])
            copies.append((local[ov[1]], src[ov[0]], files.get(r)))
            covered = True
            if e["local_shape"] == e["global_shape"]:
                break  # the old chunk is the whole tensor (replicated or plain): one is enough
        if not covered and local.numel() > 0:
            raise Unsupported(f"{key}: no old chunk covers this rank's part")
    parallel_copy(copies)


COPY_PIECE = 32 << 20


def parallel_copy(pairs: list[tuple[torch.Tensor, torch.Tensor, str | None]], threads: int | None = None) -> None:
    """Fill every ``dst`` from its ``src``, large ones cut along dim 0, on a few threads.

    A ``src`` that views a file mapping (its path given) is read with ``preadv`` into ``dst``
    when both are contiguous; anything else is ``dst.copy_(src)``. Both release the GIL, and two
    or more threads roughly halve the time on a 2-core machine.
    """
    pieces: list[tuple[torch.Tensor, torch.Tensor, str | None]] = []
    for dst, src, path in pairs:
        nbytes = dst.numel() * dst.element_size()
        if dst.dim() == 0 or nbytes <= COPY_PIECE or dst.shape[0] < 2:
            pieces.append((dst, src, path))
            continue
        rows = max(1, dst.shape[0] * COPY_PIECE // nbytes)
        pieces.extend((d, s_, path) for d, s_ in zip(dst.split(rows), src.split(rows)))
    fds: dict[str, int] = {}
    try:
        for _, _, path in pieces:
            if path is not None and path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)

        def one(dst: torch.Tensor, src: torch.Tensor, path: str | None) -> None:
            if path is not None and dst.is_contiguous() and src.is_contiguous() and dst.numel() > 0:
                _pread_into(fds[path], dst, src.storage_offset() * src.element_size())
            else:
                dst.copy_(src)

        threads = threads or min(4, max(2, os.cpu_count() or 1))
        if threads == 1 or len(pieces) < 2:
            for piece in pieces:
                one(*piece)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="ftrt-restore") as pool:
            for f in [pool.submit(one, *piece) for piece in pieces]:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)


def _pread_into(fd: int, dst: torch.Tensor, offset: int) -> None:
    """Read ``dst``'s bytes from ``fd`` at ``offset`` (``dst`` contiguous, on the CPU)."""
    view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise Unsupported(f"the arena file ended {len(view) - done} bytes early")
        done += got


def needed_ranks(target_flat: dict[str, Any], old: dict[int, MemIndex], local: set[int]) -> set[int]:
    """Old ranks, not held locally, whose chunks overlap this rank's part of any tensor."""
    need: set[int] = set()
    by_rank = {r: {e["key"]: e for e in idx["entries"]} for r, idx in old.items()}
    for key, t in target_flat.items():
        local_shape, _, offset = _region(t)
        for r in sorted(old):
            e = by_rank[r].get(key)
            if e is None:
                continue
            if e["local_shape"] == e["global_shape"]:
                if not local & set(old):
                    need.add(min(old))  # any full copy will do
                break
            if _overlap(e["global_offset"], e["local_shape"], offset, local_shape) is not None:
                need.add(r)
    return need - local


def unflatten(skeleton: Any, values: dict[str, Any]) -> Any:
    """The state :func:`flatten` split, with ``values[path]`` for each tensor."""
    def tensor(path: str) -> Any:
        try:
            return values[path]
        except KeyError:
            raise skel.BadSkeleton(f"the skeleton names a tensor {path[:60]!r} that the state does not have") from None

    return skel.decode(skeleton, tensor)


__all__ = ["Arena", "BadIndex", "Choice", "HeldIndex", "IndexEntry", "Unsupported", "check_index", "choose", "fill",
           "flatten", "layout", "needed_ranks", "scan", "unflatten"]
