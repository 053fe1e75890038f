"""Stopping a command cleanly on SIGTERM, SIGHUP or SIGINT.

Commands that start processes of their own (``ftrt chaos`` its etcd and agents, ``ftrt demo`` its
job, ``ftrt etcd`` its server) stop them in ``with`` blocks and ``finally`` clauses. Python runs those
on SIGINT (``KeyboardInterrupt``) but not on SIGTERM, which is how a shell's ``kill``, a CI runner's
timeout or a container stop ends a command, so everything the command started was left running.
:func:`stop_cleanly` turns each of those signals into :class:`Stopped`, raised in the main thread.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; ``exit_code`` is the shell's 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


@contextlib.contextmanager
def stop_cleanly() -> Iterator[None]:
    """Raise :class:`Stopped` on the first stop signal. Later ones are ignored until the block is left,
    so the cleanup that the first one started (each bounded by its own timeout) is not cut short."""
    previous = {s: signal.getsignal(s) for s in SIGNALS}

    def stop(signum: int, _frame) -> None:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    for s in SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
