"""Process-tree helpers (Linux ``/proc``, ``prctl``): what the chaos harness, the vLLM engine and
the embedded etcd need to leave no process behind."""

from __future__ import annotations

import os
import signal
import sys


def die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` exits (Linux ``PR_SET_PDEATHSIG``), and at once if it
    already has. Strictly, the kernel watches the *thread* that forked this process: fork from the
    main thread or a thread that lives as long as the child should."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(70)


_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGKILL: kept across exec
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def dying_with_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that it is SIGKILLed when this process dies, even by SIGKILL (a
    ``PR_SET_PDEATHSIG`` set by a few lines of isolated Python, ``-I -S``, that then exec ``cmd``;
    no ``preexec_fn``, which is unsafe in a process with threads). ``cmd[0]`` must be a path. Start it from the main
    thread or one that lives as long as the child should (:func:`die_with`)."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
