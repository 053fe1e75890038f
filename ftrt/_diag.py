"""Diagnostic switches: turn one steady-state component off to measure what it costs.

``FTRT_DIAG_OFF=heartbeat,fence,vote,template,refill`` (any subset) is read by the benches' and
tests' runs, nowhere else. Each switch removes a safety mechanism or a saving, so it is for measurement only:

- ``heartbeat``: ``rt.heartbeat`` sends nothing (no hang detection, no steps in ``ftrt status``);
- ``fence``: workers run no fence watchdog (a frozen node's workers outlive its lease);
- ``vote``: ``Checkpointer.save(skip_if_busy=True)`` decides on this rank's view alone, without
  the collective that also orders memory checkpoints after every rank's previous step;
- ``template``: the agent starts every spare as a new Python process instead of forking it from
  its spare template (:mod:`ftrt.agents.workers.template`), as before 2026-12-03;
- ``refill``: the agent does not replace the spares a round used, so a later fault surely meets
  no warm spare (a test of the cold path that must not depend on how fast spares warm).

``FTRT_DIAG_TRACE=PATH`` makes :func:`mark` append one JSON line per phase of a worker's start
(assigned, process group, restore, first step) to ``PATH``, so a bench can split a pause into its
parts, and :func:`trace_gc` adds every slow garbage collection. A rollout server marks each group
it takes and answers, so a test can tell when a server surely holds work. Off (the default), all
of them do nothing.

``FTRT_DIAG_CRASH=POINT:STEP:RANK:MARKER`` makes the worker of global rank ``RANK`` exit (code 1,
no teardown) when it reaches :func:`crash_point` ``POINT`` in step ``STEP``, once: the first to
crash creates ``MARKER``, and none crashes once it exists. It puts a fault where a test needs it to
be sure to hit (e.g. between two optimizer steps of one training step), not where a clock says.
``FTRT_DIAG_HOLD=POINT:STEP`` makes a worker wait at :func:`holds_at` ``POINT`` of step ``STEP``
until its caller's condition (e.g. a new round came), once, so a test's join surely lands mid-run.
"""

from __future__ import annotations

import json
import os
import time

from ftrt import envnames

ENV = envnames.DIAG_OFF
COMPONENTS = ("heartbeat", "fence", "vote", "template", "refill")


def parse(raw: str) -> frozenset[str]:
    """The components named in ``raw`` (comma-separated); an unknown name is a ValueError."""
    names = frozenset(x.strip() for x in raw.split(",") if x.strip())
    if unknown := sorted(names - set(COMPONENTS)):
        raise ValueError(f"{ENV}={raw!r} names {unknown}; the components are {', '.join(COMPONENTS)}.")
    return names


_OFF = parse(os.environ.get(ENV, ""))


def off(component: str) -> bool:
    """Whether ``component`` is switched off in this process."""
    return component in _OFF


TRACE_ENV = envnames.DIAG_TRACE


def mark(event: str, **fields: object) -> None:
    """Append ``{"event", "time", "pid", "rank", **fields}`` to ``$FTRT_DIAG_TRACE`` if it is set."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = {"event": event, "time": time.time(), "pid": os.getpid(), "rank": os.environ.get("RANK"), **fields}
    with open(path, "a", encoding="utf-8") as f:  # one short write: lines from processes do not interleave
        f.write(json.dumps(line) + "\n")


def trace_gc(threshold_s: float = 0.005) -> None:
    """With ``$FTRT_DIAG_TRACE`` set, :func:`mark` every garbage collection of this process that
    takes ``threshold_s`` or more (``gc`` with its generation, objects collected and seconds), so a
    trace shows when a pause was the collector's. Off, it does nothing."""
    if not os.environ.get(TRACE_ENV):
        return
    import gc

    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            took = time.perf_counter() - started[0]
            if took >= threshold_s:
                mark("gc", generation=info["generation"], collected=info["collected"], seconds=round(took, 4))

    gc.callbacks.append(on_gc)


CRASH_ENV = envnames.DIAG_CRASH


def crash_point(point: str, step: int) -> None:
    """Exit here if ``$FTRT_DIAG_CRASH`` names this point, step and rank and has not fired yet."""
    raw = os.environ.get(CRASH_ENV)
    if not raw:
        return
    want, at, rank, marker = raw.split(":", 3)
    if want != point or int(at) != step or os.environ.get("RANK") != rank:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # fired once already (this is the replacement worker)
    os._exit(1)


HOLD_ENV = envnames.DIAG_HOLD


_HELD: set[tuple[str, int]] = set()


def holds_at(point: str, step: int) -> bool:
    """Whether ``$FTRT_DIAG_HOLD`` asks this worker to wait at this point of this step: once per
    process (a step trained again does not hold again)."""
    raw = os.environ.get(HOLD_ENV)
    if not raw:
        return False
    want, at = raw.split(":", 1)
    if want != point or int(at) != step or (point, step) in _HELD:
        return False
    _HELD.add((point, step))
    return True
