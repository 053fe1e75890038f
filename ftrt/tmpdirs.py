"""Temporary folders named for the process that owns them, and the sweep that removes those whose
owner was killed.

A process killed with SIGKILL cleans nothing up: an agent's run folder, its memory tier, an
embedded etcd's data would stay in the temporary directory for good. So each such folder carries
its owner's pid in its name (``<prefix><pid>-<random>``), and whoever makes the next one of the
same kind on this machine first removes this user's folders of that kind whose owner is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def owned_dir(prefix: str, root: str | None = None) -> str:
    """A new private folder ``<root>/<prefix><pid>-<random>`` (0700) for this process, after
    :func:`sweep` of the same kind."""
    sweep(prefix, root)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)


def owner(name: str, prefix: str) -> int | None:
    """The owner's pid in a folder name made by :func:`owned_dir`, or None."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def sweep(prefix: str, root: str | None = None) -> list[str]:
    """Remove this user's ``prefix`` folders in ``root`` (default: the temporary directory) whose
    owner process is gone; return them. One whose owner runs (or whose pid is in use again) stays."""
    base = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for folder in entries:
        pid = owner(folder.name, prefix)
        if pid is None or pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    if removed:
        log.info("removed %d folder(s) %s* left by killed processes", len(removed), base / prefix)
    return removed
