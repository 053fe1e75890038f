"""One owner for the worker -> agent report messages: ftrt/reports.py. A message type written as a
string anywhere else could drift from the side that reads it (the agent ignores types it does not
know, so a misspelt one would fail silently)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ftrt import reports

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("ftrt", "agents", "checkpoint", "chaos")


def test_report_types_are_written_only_in_reports():
    names = "|".join(re.escape(v) for k, v in vars(reports).items() if k.isupper() and isinstance(v, str))
    literal = re.compile(rf"""["']t["']\s*:\s*["']|\b(kind|msg\.get\(["']t["']\))\s*(==|!=|in)\s*\(?[^()]*["']({names})["']""")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in SOURCES for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "reports.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, "use ftrt.reports instead:\n" + "\n".join(found)


def test_each_builder_makes_its_type_and_survives_the_wire():
    made = {
        reports.READY: reports.ready(12, 2900),
        reports.EXIT: reports.spare_exit(12, -9),
        reports.HEARTBEAT: reports.heartbeat(7),
        reports.DONE: reports.done(7),
        reports.BOUNDARY: reports.boundary(),
        reports.MEM: reports.memory_saved(1, 7, 4096, 0.0123456789),
        reports.CKPT: reports.committed("storage", 0, 7, 4096, 1.5),
        reports.RESTORE: reports.restored(1, "memory", 7, 0.2),
        reports.STATS: reports.stats({"reward": 1}),
    }
    types = {v for k, v in vars(reports).items() if k.isupper() and isinstance(v, str)}
    assert set(made) == types and len(types) == 9
    for kind, msg in made.items():
        assert json.loads(json.dumps(msg)) == msg and msg["t"] == kind
    assert made[reports.STATS]["values"] == {"reward": 1.0}
    assert made[reports.MEM]["save_s"] == 0.012346
    assert set(reports.CHECKPOINT_TYPES) <= types
