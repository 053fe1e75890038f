"""Index files of the memory tier's arena directories (no torch: the agent uses these too).

A directory holds ``slot-0.bin``/``slot-1.bin`` and up to two indexes: ``current.json`` (the
newest complete checkpoint) and ``previous.json`` (the one before, valid until its slot is reused).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def current_slot(directory: Path) -> int | None:
    try:
        return json.loads((directory / "current.json").read_text())["slot"]
    except (OSError, ValueError, KeyError):
        return None


def invalidate_slot(directory: Path, slot: int) -> None:
    """Withdraw whichever index points at ``slot`` before that slot is rewritten."""
    for name in ("previous.json", "current.json"):
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
    tmp.write_text(json.dumps(index))
    os.replace(tmp, current)
