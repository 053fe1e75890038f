"""The round-end file: how an agent asks its workers to end their round at a step boundary.

The one owner of that contract between an agent (:class:`RoundEndWriter`) and its workers
(:class:`RoundEndReader`, read by :meth:`ftrt.Runtime.round_ending`): a mapped record
(:mod:`ftrt.mapped`) holding the highest round asked to end, whether the node drains, and the highest
round whose end must be saved to storage. :mod:`ftrt.agents.workers.boundary` says when an agent asks.
"""

from __future__ import annotations

from ftrt import envnames
from ftrt.mapped import MappedReader, MappedWriter

ENV = envnames.ROUND_END_FILE
"""Environment variable with the round-end file's path, set for every worker of an agent."""

_FMT = "<qqqq"  # the highest round asked to end, draining (0/1), the highest asked to end durably, generation


class RoundEndWriter:
    """The agent's side: create the file (no round asked to end) and ask rounds to end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._round = 0
        self._draining = 0
        self._durable = 0
        self._record = MappedWriter(path, _FMT, 0, 0, 0)

    def request(self, round_no: int, *, durable: bool = False) -> None:
        """Ask the workers of ``round_no`` (and older) to stop at their next step boundary;
        ``durable``: their save must go to storage (the next round is inactive: the job waits or
        stops, and no memory copy may outlive the nodes)."""
        self._round = max(self._round, round_no)
        if durable:
            self._durable = max(self._durable, round_no)
        self._write()

    def drain(self) -> None:
        """Tell the workers that this node is leaving the job."""
        self._draining = 1
        self._write()

    def _write(self) -> None:
        self._record.write(self._round, self._draining, self._durable)

    def close(self) -> None:
        self._record.close()


class RoundEndReader:
    """A worker's side: whether its round was asked to end (one read of mapped memory)."""

    def __init__(self, path: str) -> None:
        self._record = MappedReader(path, _FMT)

    def ending(self, round_no: int) -> bool:
        return self._record.read()[0] >= round_no > 0

    def durable(self, round_no: int) -> bool:
        return self._record.read()[2] >= round_no > 0

    def draining(self) -> bool:
        return self._record.read()[1] == 1
