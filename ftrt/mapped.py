"""A small fixed-layout record in a memory-mapped file: how an agent tells its workers things.

The agent writes the record; its workers read it with one read of mapped memory, no system call,
so they can afford to look every step or every wake-up. Each write bumps a generation counter
stored as the record's last field. The fence file (:mod:`ftrt.agents.workers.fence`) and the round-end
file (:mod:`ftrt.roundendfile`) are such records.
"""

from __future__ import annotations

import mmap
import os
import struct


class MappedWriter:
    """The writing side: create ``path`` holding ``initial`` (generation 0) and rewrite it."""

    def __init__(self, path: str, fmt: str, *initial: object) -> None:
        self.path = path
        self._fmt = fmt
        self._size = struct.calcsize(fmt)
        with open(path, "wb") as f:
            f.write(struct.pack(fmt, *initial, 0))
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self._size)
        self._generation = 0

    def write(self, *values: object) -> None:
        """Replace the record's fields (all but the generation, which this bumps)."""
        self._generation += 1
        self._map[:self._size] = struct.pack(self._fmt, *values, self._generation)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


class MappedReader:
    """The reading side: map ``path`` read-only; :meth:`read` returns the record's fields."""

    def __init__(self, path: str, fmt: str) -> None:
        self._fmt = fmt
        self._size = struct.calcsize(fmt)
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, self._size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def read(self) -> tuple:
        """Every field, the generation last."""
        return struct.unpack(self._fmt, self._map[:self._size])
