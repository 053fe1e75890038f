"""The ftrt error hierarchy.

Every error ftrt raises on purpose derives from :class:`FtrtError`; messages are full sentences
that name the value at fault and say what to do. The CLI prints them without a traceback.
"""

from __future__ import annotations


class FtrtError(Exception):
    """Base class of all errors raised by ftrt."""

    #: Process exit code the CLI uses when this error ends a command.
    exit_code: int = 1


class ConfigError(FtrtError, ValueError):
    """A configuration value or command-line argument is invalid."""

    exit_code = 2


class StoreError(FtrtError):
    """The coordination store (etcd) failed a request."""


class StoreUnavailable(StoreError):
    """The coordination store could not be reached before the call's deadline."""


class LeaseLost(StoreError):
    """A lease expired or was revoked; keys attached to it are gone."""


class WatchCompacted(StoreError):
    """A watch asked for history that the store has already compacted away."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class NodeIdConflict(FtrtError):
    """Another live agent already holds this node id in the job."""


class RoundChanged(FtrtError):
    """A fenced write failed because the rendezvous moved on to a newer round."""


class WorldChanged(FtrtError):
    """The job's world changed under this worker (a node was lost or joined, a worker was replaced):
    the step in flight is void. Take the new round in place (:meth:`ftrt.Runtime.reconfigure`),
    agree on the state (:func:`ftrt.sync_state`) and train the step again."""


class RendezvousTimeout(FtrtError):
    """The job stayed below its minimum number of nodes for longer than the join timeout."""


class Fenced(FtrtError):
    """This agent lost its lease and stopped its workers; it must rejoin as a new member."""


class WorkerFailure(FtrtError):
    """Workers kept failing and the restart budget is spent."""


class CheckpointCorrupt(FtrtError):
    """A checkpoint failed verification (missing file, wrong size or checksum)."""


class CheckpointSaveFailed(FtrtError):
    """A checkpoint could not be persisted; nothing was committed."""


class CheckpointUnavailable(FtrtError):
    """The checkpoint storage cannot be read now and no memory checkpoint can stand in for it."""
