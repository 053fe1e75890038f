"""The worker -> agent report messages: the one owner of their types, shapes and wire form.

A worker writes JSON lines to the pipe named by ``FTRT_REPORT_FD`` (:meth:`ftrt.Runtime.report`);
its agent reads them (:mod:`ftrt.agents.workers.pool`). Each message is one of the frozen dataclasses
below, written by :func:`encode` as an object whose ``"t"`` is the class's ``TYPE`` and read back
by :func:`decode`, the one decoder. A message is never acknowledged, and one the agent is too far
behind to read is dropped, so none may be needed for correctness: they drive supervision
(heartbeats), replication (:class:`MemorySaved`), the metrics and the event log. :func:`decode`
returns None for a type it does not know (a newer worker) and for a message whose fields are
missing or of the wrong type, so a reader dispatches on the class only (``match``/``isinstance``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Union


@dataclass(frozen=True)
class Ready:
    """A warm worker (or the spare template) is ready for an assignment; ``store_port``: the round's
    TCPStore it pre-started (0: none)."""

    TYPE: ClassVar[str] = "ready"
    pid: int
    store_port: int


@dataclass(frozen=True)
class SpareExit:
    """From the spare template only: a spare it forked has exited with Popen-style ``code`` (the agent
    is not that process's parent, so it cannot wait for it)."""

    TYPE: ClassVar[str] = "exit"
    pid: int
    code: int


@dataclass(frozen=True)
class Heartbeat:
    """The worker reached ``step`` (:meth:`ftrt.Runtime.heartbeat`). After the first, a worker silent
    for the agent's ``--hang-timeout`` is hung."""

    TYPE: ClassVar[str] = "hb"
    step: int
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Done:
    """The worker finished its work (:meth:`ftrt.Runtime.done`); what follows is its teardown, which
    hang detection does not judge."""

    TYPE: ClassVar[str] = "done"
    step: int


@dataclass(frozen=True)
class Boundary:
    """The worker polls the round-end file (:mod:`ftrt.roundendfile`, :mod:`ftrt.agents.workers.boundary`)."""

    TYPE: ClassVar[str] = "boundary"


@dataclass(frozen=True)
class BoundaryAt:
    """Asked to end ``round`` at a step boundary, the worker ends it after ``step``, its trainer's
    next natural boundary (the end of a generation window), not after the step in progress
    (:meth:`ftrt.Runtime.round_ends_after`): the agent waits for those steps too, within bounds."""

    TYPE: ClassVar[str] = "boundary_at"
    round: int
    step: int


@dataclass(frozen=True)
class InPlace:
    """The worker changes rounds without exiting (:meth:`ftrt.Runtime.init_process_group` under
    ``--recovery in-place``): at the next round the agent hands it the round
    (:class:`ftrt.control.NewRound`) instead of replacing it."""

    TYPE: ClassVar[str] = "inplace"


@dataclass(frozen=True)
class Reconfigured:
    """The worker took ``round`` in place: its new process group is up (:meth:`ftrt.Runtime.reconfigure`)."""

    TYPE: ClassVar[str] = "reconf"
    round: int


@dataclass(frozen=True)
class MemorySaved:
    """A memory checkpoint of ``rank`` at ``step`` is complete in the node's memory directory; the
    agent replicates it to its peers and counts it in the metrics."""

    TYPE: ClassVar[str] = "mem"
    rank: int
    step: int
    bytes: int
    save_s: float = field(metadata={"digits": 6})


@dataclass(frozen=True)
class Committed:
    """A checkpoint of ``step`` was committed to ``tier``."""

    TYPE: ClassVar[str] = "ckpt"
    tier: str
    rank: int
    step: int
    bytes: int
    save_s: float = field(metadata={"digits": 6})


@dataclass(frozen=True)
class Restored:
    """The worker restored ``step`` from ``tier`` (None: nothing to restore)."""

    TYPE: ClassVar[str] = "restore"
    rank: int
    tier: str | None
    step: int
    seconds: float = field(metadata={"digits": 6})


@dataclass(frozen=True)
class Stats:
    """Trainer metrics for Prometheus (:meth:`ftrt.Runtime.report_metrics`), by name."""

    TYPE: ClassVar[str] = "stats"
    values: Mapping[str, float]


Report = Union[Ready, SpareExit, Heartbeat, Done, Boundary, BoundaryAt, InPlace, Reconfigured, MemorySaved, Committed, Restored,
               Stats]
"""Any worker report."""

TYPES: dict[str, type] = {cls.TYPE: cls for cls in (Ready, SpareExit, Heartbeat, Done, Boundary, BoundaryAt, InPlace,
                                                   Reconfigured, MemorySaved, Committed, Restored, Stats)}
"""Every report class by its wire type."""

CHECKPOINT_REPORTS = (MemorySaved, Committed, Restored)
"""The checkpointer's reports (its ``report=`` callback receives these)."""

def encode(report: Report) -> bytes:
    """One report as its JSON line."""
    body: dict[str, Any] = {"t": report.TYPE}
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        if "digits" in f.metadata:  # durations travel rounded (to microseconds)
            value = round(value, f.metadata["digits"])
        elif isinstance(value, Mapping):
            value = {str(k): float(v) for k, v in value.items()}
        body[f.name] = value
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> Report | None:
    """The report on one JSON line, or None: not JSON, not an object, a type this version does not
    know, or a field missing or of the wrong type. Never raises."""
    try:
        body = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    cls = TYPES.get(body.get("t")) if isinstance(body.get("t"), str) else None
    if cls is None:
        return None
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return None
            continue
        value = _checked(body[f.name], f.type)
        if value is _BAD:
            return None
        values[f.name] = value
    return cls(**values)


_BAD = object()


def _checked(value: Any, kind: str) -> Any:
    """``value`` as the field type ``kind`` (a string: the module uses postponed annotations), or _BAD."""
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else _BAD
    if kind == "str":
        return value if isinstance(value, str) else _BAD
    if kind == "str | None":
        return value if value is None or isinstance(value, str) else _BAD
    if kind == "Mapping[str, float]":
        if not isinstance(value, dict):
            return _BAD
        out = {}
        for k, v in value.items():
            number = _checked(v, "float")
            if number is _BAD:
                return _BAD
            out[k] = number
        return out
    raise TypeError(f"reports: no check for field type {kind!r}")  # a new field type needs one here
