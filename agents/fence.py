"""The fence file: how an agent's lease deadline reaches its workers without any I/O call.

The agent maps a 16-byte file and writes into it the monotonic time until which its lease is
surely alive. Each worker started by ftrt runs a watchdog thread that reads it every 100 ms and
exits the process once that time has passed. This keeps the promise "a node that lost its
membership stops training" even when the agent itself is frozen (SIGSTOP) or wedged: a thawed
worker notices within one watchdog period, before it can take part in a newer round.

``time.monotonic()`` is CLOCK_MONOTONIC on Linux, shared by every process on the machine.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import time

_FMT = "<dq"  # valid_until (monotonic seconds), generation
_SIZE = struct.calcsize(_FMT)
FENCED = -1.0
"""``valid_until`` value meaning: stop at once."""
UNSET = 0.0
"""``valid_until`` value meaning: no deadline yet (warm workers wait unfenced)."""


class FenceWriter:
    """The agent's side: create the file and update the deadline."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "wb") as f:
            f.write(struct.pack(_FMT, UNSET, 0))
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _SIZE)
        self._generation = 0

    def set(self, valid_until: float) -> None:
        self._generation += 1
        self._map[:_SIZE] = struct.pack(_FMT, valid_until, self._generation)

    def fence(self) -> None:
        self.set(FENCED)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


def read_deadline(path: str) -> float:
    """Read the deadline once (for tests and diagnostics)."""
    with open(path, "rb") as f:
        return struct.unpack(_FMT, f.read(_SIZE))[0]


def start_watchdog(path: str, interval: float = 0.1, exit_code: int = 75) -> threading.Thread:
    """Start the worker-side daemon thread that exits the process once the deadline passed."""
    fd = os.open(path, os.O_RDONLY)
    view = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)

    def run() -> None:
        while True:
            valid_until, _ = struct.unpack(_FMT, view[:_SIZE])
            if valid_until == FENCED or (valid_until > 0 and time.monotonic() > valid_until):
                reason = "was fenced" if valid_until == FENCED else "could not renew its lease in time"
                sys.stderr.write(f"ftrt: this node's agent {reason}; stopping this worker.\n")
                sys.stderr.flush()
                os._exit(exit_code)
            time.sleep(interval)

    thread = threading.Thread(target=run, name="ftrt-fence-watchdog", daemon=True)
    thread.start()
    return thread
