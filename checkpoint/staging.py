"""Staging: copy a state's tensors out of the training loop's hands into reusable buffers.

The stager owns ``slots`` buffer sets. A save takes a free slot (waiting if all are busy: that
bound caps host memory at ``slots`` copies of the state), copies every tensor into that slot's
buffers, and gives the slot back once the copy is persisted. Buffers are allocated on first use
and reused while shapes and dtypes stay the same, so steady-state saves allocate nothing.

DTensors are staged by their local shard and rebuilt around the staged buffer with the same mesh,
placements, global shape and stride (no communication), so DCP still sees a sharded tensor and can
reshard on load. CUDA tensors are copied into pinned host buffers with non-blocking copies and one
synchronisation at the end. Plain Python values are deep-copied when the save is called.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment]


def _is_dtensor(x: Any) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


class Stager:
    """Fixed set of reusable staging buffers. Thread-safe acquire/release."""

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"staging slots must be >= 1, got {slots}")
        self._buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._free = list(reversed(range(slots)))
        self._cond = threading.Condition()
        self.allocated_bytes = 0

    def acquire(self, avoid: int | None = None) -> int:
        """A free slot other than ``avoid``; blocks while there is none.

        Slots are busy while their save is being persisted. The most recently freed slot comes
        first: its buffers are warm (allocated, paged in), the other one is only used when saves
        overlap. ``avoid`` is the memory tier's current checkpoint, which must not be overwritten.
        """
        with self._cond:
            while True:
                usable = [s for s in self._free if s != avoid] if len(self._buffers) > 1 else self._free
                if usable:
                    slot = usable[-1]
                    self._free.remove(slot)
                    return slot
                self._cond.wait()

    def has_free(self, avoid: int | None = None) -> bool:
        """Whether :meth:`acquire` with ``avoid`` would return at once."""
        with self._cond:
            return bool([s for s in self._free if s != avoid] if len(self._buffers) > 1 else self._free)

    def prewarm(self) -> None:
        """Give every free, still-empty slot buffers shaped like a used slot's, paged in.

        Called in the background after the first save, so that a later save that overlaps a slow
        persistence (and therefore needs the other slot) does not pay for page faults.
        """
        template = next((b for b in self._buffers if b), None)
        if template is None:
            return
        with self._cond:
            empty = [i for i in self._free if not self._buffers[i]]
            for i in empty:
                self._free.remove(i)
        try:
            for i in empty:
                for path, src in template.items():
                    buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_pinned())
                    buf.zero_()  # touch every page now
                    self._buffers[i][path] = buf
                    self.allocated_bytes += buf.numel() * buf.element_size()
        finally:
            with self._cond:
                # Behind the warm slots in LIFO order: used only when saves overlap.
                self._free[:0] = empty
                self._cond.notify_all()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def snapshot_plain(self, sd: Any) -> Any:
        """Deep-copy the non-tensor leaves now (the caller may change them right after save)."""
        if isinstance(sd, dict):
            return {k: self.snapshot_plain(v) for k, v in sd.items()}
        if isinstance(sd, (list, tuple)):
            return type(sd)(self.snapshot_plain(v) for v in sd)
        if isinstance(sd, torch.Tensor):
            return sd
        return copy.deepcopy(sd)

    def stage(self, slot: int, sd: Any) -> Any:
        """Copy every tensor of ``sd`` into ``slot``'s buffers; return the staged structure."""
        bufs = self._buffers[slot]
        cuda = [False]
        staged = self._walk(sd, "", bufs, cuda)
        if cuda[0]:
            torch.cuda.synchronize()
        return staged

    def _buffer(self, bufs: dict, path: str, src: torch.Tensor) -> torch.Tensor:
        buf = bufs.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.is_cuda and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            if path in bufs:
                self.allocated_bytes -= bufs[path].numel() * bufs[path].element_size()
            bufs[path] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def _walk(self, sd: Any, path: str, bufs: dict, cuda: list) -> Any:
        if isinstance(sd, dict):
            return {k: self._walk(v, f"{path}/{k}", bufs, cuda) for k, v in sd.items()}
        if isinstance(sd, (list, tuple)):
            return type(sd)(self._walk(v, f"{path}/{i}", bufs, cuda) for i, v in enumerate(sd))
        if _is_dtensor(sd):
            local = sd.to_local()
            buf = self._buffer(bufs, path, local)
            buf.copy_(local, non_blocking=local.is_cuda)
            cuda[0] |= local.is_cuda
            return DTensor.from_local(
                buf, sd.device_mesh, sd.placements, run_check=False, shape=sd.shape, stride=sd.stride()
            )
        if isinstance(sd, torch.Tensor):
            buf = self._buffer(bufs, path, sd)
            buf.copy_(sd.detach(), non_blocking=sd.is_cuda)
            cuda[0] |= sd.is_cuda
            return buf
        return sd
