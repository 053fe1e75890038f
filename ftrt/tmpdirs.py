"""Temporary folders held by the process that made them, and the sweep that removes those whose
owner was killed.

A process killed with SIGKILL cleans nothing up: an agent's run folder, its memory tier, an
embedded etcd's data would stay in the temporary directory for good. So each such folder holds a
lock file that its owner keeps locked (``flock``) for as long as it lives; the kernel releases
the lock when the owner dies, however it dies. Whoever makes the next folder of the same kind on
this machine first removes those whose lock it can take. A lock works across PID namespaces
(containers sharing ``/tmp`` or ``/dev/shm``), where a pid would not: a folder whose owner runs
in another container stays. The owner's pid is in the name only to tell people whose it is.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK = ".owner.lock"
"""Inside each folder: the file its owner keeps locked."""

_held: dict[str, int] = {}
"""This process's folders and the descriptors of their locks (closed by :func:`remove`)."""


def owned_dir(prefix: str, root: str | None = None) -> str:
    """A new private folder ``<root>/<prefix><pid>-<random>`` (0700) held by this process, after
    :func:`sweep` of the same kind. Remove it with :func:`remove`."""
    sweep(prefix, root)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _held[path] = fd
    return path


def remove(path: str) -> None:
    """Remove a folder made by :func:`owned_dir` and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def owner(name: str, prefix: str) -> int | None:
    """The pid in a folder name made by :func:`owned_dir` (for people; the lock decides), or None."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def abandoned(folder: Path) -> bool:
    """Whether nobody holds ``folder``'s lock: its owner is gone. A folder without one (not made
    by :func:`owned_dir`) is never taken for abandoned."""
    try:
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # A lock file younger than a second may be one whose owner has not locked it yet.
        return time.time() - os.fstat(fd).st_mtime > 1.0
    except OSError:
        return False  # held: its owner lives
    finally:
        os.close(fd)


def sweep(prefix: str, root: str | None = None) -> list[str]:
    """Remove the ``prefix`` folders in ``root`` (default: the temporary directory) that this user
    owns and whose owner process is gone (:func:`abandoned`); return them."""
    base = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = [p for p in base.iterdir() if owner(p.name, prefix) is not None]
    except OSError:
        return removed
    for folder in entries:
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if str(folder) in _held or not abandoned(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    if removed:
        log.info("removed %d folder(s) %s* left by killed processes", len(removed), base / prefix)
    return removed
