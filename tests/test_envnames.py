"""One owner for the FTRT_* environment names: ftrt/envnames.py. A name written as a string
anywhere else could drift from the side that reads it."""

from __future__ import annotations

import re
from pathlib import Path

from ftrt import envnames

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("ftrt", "agents", "checkpoint", "chaos")


def test_every_ftrt_environment_name_is_written_only_in_envnames():
    literal = re.compile(r"""["']FTRT_[A-Z_]+["']|(?<!`)\bFTRT_[A-Z_]+=""")  # not ``NAME=value`` in prose
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in SOURCES for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "envnames.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, "use ftrt.envnames instead:\n" + "\n".join(found)


def test_the_names_are_distinct_and_say_what_they_are():
    names = {k: v for k, v in vars(envnames).items() if k.isupper()}
    assert len(set(names.values())) == len(names)
    assert all(v == f"FTRT_{k}" for k, v in names.items())
