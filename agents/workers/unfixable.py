"""Errors no restart can mend: a worker whose script cannot be imported, does not parse, or was
given a command line it refuses fails the same way every time it is started again.

The worker's bootstrap (:mod:`ftrt.agents.workers._bootstrap`) asks :func:`explain` about the
exception its script ended with; for one of these it writes the one-line explanation to
:func:`note_path` (beside the round's torchelastic error file) before it exits. The agent reads it
with :func:`read_note` when it handles the exit and fails the job at once, with that line, instead
of spending ``--max-restarts`` on restarts that print the same traceback again
(:func:`ftrt.agents.rendezvous.decide.decide_round`, a request of kind ``unfixable``).

Which errors count, and why:

- ``SyntaxError`` (and ``IndentationError``) in a source file: it does not parse. (Code compiled at
  run time, ``exec`` of generated code, does not count.)
- ``ImportError`` (and ``ModuleNotFoundError``): a module or a name in it is missing; every start
  of the same code on the same node looks it up the same way.
- ``SystemExit`` with code 2: the command-line usage error of argparse (and of ``ftrt grpo``'s
  configuration check); the arguments are the same at every start.

Only before the worker got going: the agent counts a note only from a worker that has not sent a
heartbeat or joined a round in place yet. Later the same errors (a compile cache race, a lazy import
on a node missing a package) are restarted like any failure, so an elastic job can go on.

Everything else (a crash, an OOM kill, a lost peer, an I/O error) may pass, and is restarted.
"""

from __future__ import annotations

import os
import runpy
import traceback

USAGE_EXIT = 2
"""argparse's exit code for a command line it refuses."""

_SUFFIX = ".unfixable"


def explain(exc: BaseException) -> str | None:
    """One line saying why ``exc`` ends every start of the script the same way, or None when a
    restart might get past it."""
    if isinstance(exc, SystemExit):
        if exc.code == USAGE_EXIT:
            return "a command-line usage error (its message is in the worker's output above)"
        return None
    if not isinstance(exc, (SyntaxError, ImportError)):
        return None
    if isinstance(exc, SyntaxError) and not (exc.filename and os.path.isfile(exc.filename)):
        return None  # code compiled at run time (exec, a reward function's generated code): not the script's
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if isinstance(exc, SyntaxError):
        return f"{text} (in {exc.filename}, line {exc.lineno})"
    where = _raised_at(exc)
    return f"{text} ({where})" if where else text


def _raised_at(exc: BaseException) -> str:
    """Where in the user's code ``exc`` was raised: its innermost frame outside the import
    machinery and the bootstrap, as "at FILE, line N" ("" when there is none)."""
    here = os.path.dirname(os.path.abspath(__file__))
    machinery = {os.path.abspath(runpy.__file__), os.path.join(here, "_bootstrap.py")}
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and os.path.abspath(f.filename) not in machinery]
    if not frames:
        return ""
    last = frames[-1]
    return f"at {last.filename}, line {last.lineno}"


def note_path(error_file: str) -> str:
    """Where a worker whose torchelastic error file is ``error_file`` notes an unfixable error."""
    root, _ = os.path.splitext(error_file)
    return root + _SUFFIX


def write_note(error_file: str, why: str) -> None:
    """Note ``why`` for the agent; best effort (the exit is reported as a plain failure without it)."""
    try:
        os.makedirs(os.path.dirname(error_file) or ".", exist_ok=True)
        with open(note_path(error_file), "w", encoding="utf-8") as f:
            f.write(why[:500])
    except OSError:
        pass


def read_note(error_file: str) -> str | None:
    """The note a worker left for ``error_file``, or None if it left none."""
    try:
        with open(note_path(error_file), encoding="utf-8", errors="replace") as f:
            text = f.read(500).strip()
    except OSError:
        return None
    return " ".join(text.split()) or None
