"""Folders and files only this user can open, whatever the umask: the memory tier's checkpoints
(the job's weights on the host's shared memory) and the credentials of the etcds ftrt starts.

Folders are 0700 and files 0600. The mode is set after creation too (``mkdir`` and ``open`` pass
theirs through the umask), and a file that existed with a wider mode is narrowed when rewritten.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path | str) -> Path:
    """Make ``path`` and its missing parents as folders only this user can enter (0700, whatever
    the umask); an existing folder of this user's is made 0700 too. Returns it as a Path."""
    path = Path(path)
    missing = []
    at = path
    while not at.is_dir():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile (another rank of the node)
            pass
    for folder in missing or [path]:  # mkdir's mode went through the umask
        _chmod_mine(folder, PRIVATE_DIR_MODE)
    return path


def _chmod_mine(path: Path, mode: int) -> None:
    """chmod ``path`` to ``mode`` when it is this user's and differs (a folder another user made
    is left alone: its owner decides)."""
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o777 != mode:
        os.chmod(path, mode)


def private_file(path: Path | str) -> BinaryIO:
    """``open(path, "wb")`` for a file only this user can read or write (0600, whatever the umask,
    also when it existed with another mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def write_private(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` as a private file (:func:`private_file`)."""
    with private_file(path) as f:
        f.write(data)
