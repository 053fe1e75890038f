"""What reaches an agent's loop from outside it: stop signals, exited workers and pokes.

The loop (:meth:`ftrt.agents.agent.Agent.run`) is the one consumer of its :class:`Inbox`; every
other task (a watch seeing the job change, a worker exiting, a peer found dead, a signal) only
pokes it, so the loop decides everything in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from ftrt.agents.workers.pool import Worker

log = logging.getLogger(__name__)


class StopSignal:
    """SIGINT and SIGTERM, caught from before the agent is assembled until everything it built is
    closed. With ``drain``, the first SIGTERM asks the agent to drain (leave gracefully,
    :meth:`Agent._begin_drain`); SIGINT, or a SIGTERM after that, stops it at once. Once stopping,
    further signals are ignored, so cleanup is not cut short."""

    def __init__(self, drain: bool = False) -> None:
        self.signum: int | None = None
        """The signal that stops the agent at once, or None."""
        self.drain_asked = False
        """A SIGTERM asked for a drain."""
        self._drain = drain
        self._listeners: list = []

    def catch(self, signum: int) -> None:
        if self.signum is not None:
            return
        if signum == signal.SIGTERM and self._drain and not self.drain_asked:
            self.drain_asked = True
            log.info("received SIGTERM; draining (a second SIGTERM stops at once)")
        else:
            self.signum = signum
            log.info("received %s; stopping", signal.Signals(signum).name)
        for listener in self._listeners:
            listener()

    def on_stop(self, listener) -> None:
        self._listeners.append(listener)


class Inbox:
    """What reaches the agent's loop from other tasks: exited workers, and pokes (a view change, a
    stop signal, a peer found dead). The loop is its one consumer. A change is counted, not
    cleared, so a wait never loses one that came while the loop was busy."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()
        self._exited: list[Worker] = []

    def poke(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    def worker_exited(self, worker: Worker) -> None:
        self._exited.append(worker)
        self.poke()

    def take_exited(self) -> list[Worker]:
        exited, self._exited = self._exited, []
        return exited

    async def wait(self, since: int, timeout: float) -> None:
        """Return once something arrived after ``since`` (a :attr:`version`), or after ``timeout``."""
        if self.version > since:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
