"""Index files of the memory tier's arena directories (no torch: the agent uses these too).

A directory holds ``slot-0.bin``/``slot-1.bin`` and up to two indexes: ``current.json`` (the
newest complete checkpoint) and ``previous.json`` (the one before, valid until its slot is reused).
The memory tier holds the job's weights and optimizer state on the host's shared memory, so its
folders are 0700 and its files 0600 (:mod:`ftrt.privatefiles`): another local user can neither
read a checkpoint nor plant one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ftrt.privatefiles import write_private


def current_slot(directory: Path) -> int | None:
    try:
        return json.loads((directory / "current.json").read_text())["slot"]
    except (OSError, ValueError, KeyError):
        return None


INDEXES = ("previous.json", "current.json")
"""A directory's index files, in the order a slot's checkpoint is withdrawn (:func:`invalidate_slot`)."""


def index_slots(directory: Path) -> dict[str, int]:
    """The slot each index file of ``directory`` names, by file name (files absent or unreadable left out)."""
    out: dict[str, int] = {}
    for name in INDEXES:
        try:
            slot = json.loads((directory / name).read_text())["slot"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if type(slot) is int:
            out[name] = slot
    return out


def withdraw(directory: Path, names: list[str]) -> None:
    """Remove these index files of ``directory`` (in :data:`INDEXES` order); absent ones are fine."""
    for name in INDEXES:
        if name in names:
            try:
                (directory / name).unlink()
            except FileNotFoundError:
                pass


def invalidate_slot(directory: Path, slot: int) -> None:
    """Withdraw whichever index points at ``slot`` before that slot is rewritten."""
    for name in INDEXES:
        path = directory / name
        try:
            if json.loads(path.read_text())["slot"] == slot:
                path.unlink()
        except (OSError, ValueError, KeyError):
            pass


def publish_index(directory: Path, index: dict) -> None:
    """current.json becomes previous.json; the new index becomes current.json (atomic renames)."""
    current = directory / "current.json"
    if current.exists():
        os.replace(current, directory / "previous.json")
    tmp = directory / "current.json.tmp"
    write_private(tmp, json.dumps(index).encode())
    os.replace(tmp, current)
