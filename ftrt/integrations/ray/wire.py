"""The messages between a node host (:mod:`~ftrt.integrations.ray.host`) and its workers
(:mod:`~ftrt.integrations.ray.worker`): the one owner of their shapes.

They travel over a :mod:`multiprocessing.connection` Unix socket in the host's private folder
(mode 0700). The connection authenticates both ends with the host's key (an HMAC challenge, before
either side unpickles anything); the key reaches the workers in their environment through the
node's agent, so only processes the host started can talk to it. What the driver passes and what
the methods return travel as opaque ``payload`` bytes (cloudpickled by the driver, as Ray itself
does; pickled by the worker): the host forwards them without reading them, so any value Ray can
carry reaches the worker, and one that cannot be pickled fails its call, not the host. Nothing
crosses machines on this socket.

Order of a worker's life: :class:`Hello` -> (host) :class:`Init` -> :class:`Ready` once its group is
up -> then, per call, (host) :class:`Call` -> :class:`Reply`; :class:`Stop` ends it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hello:
    """A worker connected; it has not joined a round yet."""

    local_rank: int
    pid: int


@dataclass(frozen=True)
class Init:
    """How the worker builds the group's worker object: ``target`` is ``module:Class``; ``payload``
    the pickled ``(args, kwargs)``."""

    target: str
    payload: bytes


@dataclass(frozen=True)
class Place:
    """Where a worker is: its round, rank and world size."""

    round: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class Ready:
    """The worker's object is built and its process group is up (its node is admitted); sent
    again each time it enters a new round."""

    local_rank: int
    pid: int
    place: Place


@dataclass(frozen=True)
class Call:
    """Run ``method(*args, **kwargs)`` on the worker object, ``payload`` the pickled ``(args,
    kwargs)``; ``seq`` names the call (the driver's calls have increasing numbers)."""

    seq: int
    method: str
    payload: bytes


@dataclass(frozen=True)
class Reply:
    """What call ``seq`` gave on one worker, and where the worker ran it: ``value`` (the pickled
    return value) when ``ok``, else ``error`` (the exception's traceback, as text)."""

    seq: int
    local_rank: int
    pid: int
    place: Place
    ok: bool
    value: bytes = b""
    error: str = ""


@dataclass(frozen=True)
class Stop:
    """The group is closing: the worker returns from its script (exit code 0)."""


AUTH_BYTES = 32
"""Length of the host's key."""
