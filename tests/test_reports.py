"""One owner for the worker -> agent report messages: ftrt/reports.py. A message type written as a
string anywhere else could drift from the side that reads it (the agent ignores types it does not
know, so a misspelt one would fail silently); every report survives the wire; the one decoder
refuses whatever does not fit a report's shape instead of raising."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ftrt import reports

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("ftrt", "agents", "checkpoint", "chaos")


def test_report_types_are_written_only_in_reports():
    names = "|".join(re.escape(t) for t in reports.TYPES)
    literal = re.compile(rf"""["']t["']\s*:\s*["']|\b(kind|msg\.get\(["']t["']\))\s*(==|!=|in)\s*\(?[^()]*["']({names})["']""")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in SOURCES for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "reports.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, "use ftrt.reports instead:\n" + "\n".join(found)


MADE = [
    reports.Ready(12, 2900),
    reports.SpareExit(12, -9),
    reports.Heartbeat(7),
    reports.Done(7),
    reports.Boundary(),
    reports.BoundaryAt(3, 8),
    reports.InPlace(),
    reports.Reconfigured(4),
    reports.MemorySaved(1, 7, 4096, 0.0123456789),
    reports.Committed("storage", 0, 7, 4096, 1.5),
    reports.Restored(1, "memory", 7, 0.2),
    reports.Restored(1, None, 0, 0.0),
    reports.Stats({"reward": 1}),
]


def test_each_report_has_its_type_and_survives_the_wire():
    assert {type(r).TYPE for r in MADE} == set(reports.TYPES) and len(reports.TYPES) == 12
    for report in MADE:
        line = reports.encode(report)
        assert line.endswith(b"\n") and json.loads(line)["t"] == type(report).TYPE
        back = reports.decode(line)
        assert type(back) is type(report)
    assert reports.decode(reports.encode(reports.Stats({"reward": 1}))).values == {"reward": 1.0}
    saved = next(r for r in MADE if isinstance(r, reports.MemorySaved))
    assert json.loads(reports.encode(saved))["save_s"] == 0.012346  # durations travel to the microsecond
    committed = next(r for r in MADE if isinstance(r, reports.Committed))
    assert reports.decode(reports.encode(committed)) == committed
    assert reports.decode(reports.encode(reports.Reconfigured(4))) == reports.Reconfigured(4)
    assert set(reports.CHECKPOINT_REPORTS) <= set(reports.TYPES.values())


@pytest.mark.parametrize("line", [
    b"not json", b"[1, 2]", b"{}", b'{"t": 3}', b'{"t": "from-a-newer-worker", "step": 1}',
    b'{"t": "hb"}', b'{"t": "hb", "step": "7"}', b'{"t": "hb", "step": true}', b'{"t": "hb", "step": 1.5}',
    b'{"t": "ckpt", "tier": "storage", "step": 1}', b'{"t": "ckpt", "tier": 1, "rank": 0, "step": 1, "bytes": 1, '
    b'"save_s": 0.1}', b'{"t": "restore", "rank": 0, "tier": "memory", "step": 1, "seconds": NaN}',
    b'{"t": "stats", "values": {"kl": "high"}}', b'{"t": "stats", "values": [1]}', b"\xff\xfe",
])
def test_what_does_not_fit_a_report_decodes_to_none(line):
    assert reports.decode(line) is None


def test_a_field_this_version_does_not_know_is_ignored():
    assert reports.decode(b'{"t": "done", "step": 3, "extra": 1}') == reports.Done(3)
