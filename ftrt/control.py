"""The agent -> worker control messages after the assignment: the one owner of their shape and
wire form, and the worker's end of the channel.

A worker's control pipe (``FTRT_CONTROL_FD``) first carries its assignment
(:mod:`ftrt.agents.workers._bootstrap`). A worker that changes rounds in place
(:meth:`ftrt.Runtime.init_process_group` under ``ftrt launch --recovery in-place``) keeps reading
it: each later round reaches it as one :class:`NewRound` JSON line, the round's number and the
worker's new torchrun/ftrt environment (:func:`ftrt.agents.workers.env.worker_env`). The worker
acknowledges with :class:`ftrt.reports.Reconfigured` once its new process group is up.

Only the newest round matters: rounds the worker missed while it trained are skipped. The agent
is the only writer; what it sends is still checked (:func:`decode`), as everything read from a pipe.

A round that only adds members to the worker's round (a join: no fault between, every member kept)
says so (:attr:`NewRound.adds_to`): no peer of the old round is lost, so its ranks may finish the
step in flight before they take it, once they agreed on which step that is
(:meth:`ftrt.Runtime.step` with ``agreed_joins=True``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import select
import stat
import time
from dataclasses import dataclass
from typing import Mapping

_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}\Z")


@dataclass(frozen=True)
class NewRound:
    """The worker's next round: its number and the environment the worker runs in from then on
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``FTRT_ROUND``...)."""

    round: int
    env: Mapping[str, str]
    adds_to: int | None = None
    """The round this one only adds members to (a join, no fault since it), or None: the ranks of
    that round lose no peer, so a collective of theirs in flight can still complete."""

    TYPE = "round"


def encode(message: NewRound) -> bytes:
    """One message as its JSON line."""
    body: dict[str, object] = {"t": message.TYPE, "round": message.round, "env": dict(message.env)}
    if message.adds_to is not None:
        body["adds_to"] = message.adds_to
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def _round_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def decode(line: bytes | str) -> NewRound | None:
    """The message on one JSON line, or None when it is not one this version knows or is malformed
    (a round, or the round it adds to, that is not a non-negative integer, an environment that is
    not upper-case names to strings). Never raises."""
    try:
        body = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict) or body.get("t") != NewRound.TYPE:
        return None
    rnd, env, adds_to = body.get("round"), body.get("env"), body.get("adds_to")
    if not _round_number(rnd) or not isinstance(env, dict):
        return None
    if adds_to is not None and not (_round_number(adds_to) and adds_to < rnd):
        return None
    if not all(isinstance(k, str) and _NAME.match(k) and isinstance(v, str) for k, v in env.items()):
        return None
    return NewRound(rnd, dict(env), adds_to)


class ControlChannel:
    """The worker's end of its control pipe, after the assignment: non-blocking, newest round wins.

    ``after``: rounds up to this one are old news (the worker runs in it already)."""

    def __init__(self, fd: int, after: int) -> None:
        self.fd = fd
        self.after = after
        self.closed = False
        """The agent closed the pipe (it is gone, or this worker will not get another round)."""
        self._buffer = b""
        self._pending: NewRound | None = None
        os.set_blocking(fd, False)

    @classmethod
    def open(cls, fd: int, after: int) -> "ControlChannel | None":
        """The channel on ``fd`` if it is a pipe this process holds, else None (e.g. a child process
        that inherited the variable but not the descriptor)."""
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return None
        except OSError:
            return None
        return cls(fd, after)

    def poll(self) -> NewRound | None:
        """The newest round the agent sent and nobody took yet, without waiting (one read)."""
        self._read()
        return self._pending

    def take(self) -> NewRound | None:
        """Like :meth:`poll`, and the round is then taken: later polls see only newer rounds."""
        message = self.poll()
        if message is not None:
            self._pending, self.after = None, message.round
        return message

    def wait(self, timeout: float) -> NewRound | None:
        """Wait up to ``timeout`` seconds for a new round (:meth:`poll` until one came); None if
        none came or the pipe closed."""
        deadline = time.monotonic() + timeout
        while (message := self.poll()) is None and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self.fd], [], [], left)
        return message

    def _read(self) -> None:
        while not self.closed:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EINVAL):
                    self.closed = True
                    return
                raise
            if not chunk:
                self.closed = True
                return
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                message = decode(line)
                if message is not None and message.round > self.after and (
                        self._pending is None or message.round > self._pending.round):
                    self._pending = message
