"""Process-tree helpers (Linux ``/proc``): what the chaos harness and the vLLM engine need to
leave no process behind."""

from __future__ import annotations

import os


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
