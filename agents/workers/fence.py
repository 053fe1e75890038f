"""The fence file: how an agent's lease deadline reaches its workers without any I/O call.

The agent maps a 16-byte file and writes into it the monotonic time until which its lease is
surely alive. Each worker started by ftrt runs a watchdog thread that sleeps until that time (at
most ``max_interval``), reads it again, and exits the process once it has passed. This keeps the
promise "a node that lost its membership stops training" even when the agent itself is frozen
(SIGSTOP) or wedged: the watchdog wakes at the deadline, and a thawed worker's watchdog, whose
sleep ended while it was stopped, runs at once, before the worker can take part in a newer round.

Sleeping until the deadline instead of polling keeps the thread quiet in steady state (about one
wake-up a second instead of ten): each wake-up takes the worker's GIL and, on a machine whose
cores the training saturates, a core from the training for a moment. An explicit fence (the agent
writes :data:`FENCED`) comes with the agent killing the workers itself; the watchdog notices it
within ``max_interval`` as a backstop.

``time.monotonic()`` is CLOCK_MONOTONIC on Linux, shared by every process on the machine.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time

from ftrt.mapped import MappedReader, MappedWriter

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
        self._record = MappedWriter(path, _FMT, UNSET)

    def set(self, valid_until: float) -> None:
        self._record.write(valid_until)

    def fence(self) -> None:
        self.set(FENCED)

    def close(self) -> None:
        self._record.close()


def read_deadline(path: str) -> float:
    """Read the deadline once (for tests and diagnostics)."""
    with open(path, "rb") as f:
        return struct.unpack(_FMT, f.read(_SIZE))[0]


def next_check(valid_until: float, now: float, max_interval: float) -> float | None:
    """Seconds the watchdog may sleep before it reads the file again; ``None``: stop the worker now.

    The deadline is only ever moved forward by a live agent, so sleeping until it (just past it, so
    the check after the sleep sees it passed) misses nothing; ``max_interval`` bounds the wait for
    an explicit fence and for a deadline that is not set yet.
    """
    if valid_until == FENCED or (valid_until > 0 and now > valid_until):
        return None
    if valid_until <= 0:
        return max_interval
    return min(max_interval, valid_until - now + 0.001)


def start_watchdog(path: str, max_interval: float = 1.0, exit_code: int = 75) -> threading.Thread:
    """Start the worker-side daemon thread that exits the process once the deadline passed."""
    record = MappedReader(path, _FMT)

    def run() -> None:
        while True:
            valid_until, _ = record.read()
            wait = next_check(valid_until, time.monotonic(), max_interval)
            if wait is None:
                reason = "was fenced" if valid_until == FENCED else "could not renew its lease in time"
                sys.stderr.write(f"ftrt: this node's agent {reason}; stopping this worker.\n")
                sys.stderr.flush()
                os._exit(exit_code)
            time.sleep(wait)

    thread = threading.Thread(target=run, name="ftrt-fence-watchdog", daemon=True)
    thread.start()
    return thread
