"""Text for the command lines (every command's ``--help``): a module docstring's first line as
argparse shows it. Imports nothing of ftrt, so any package's command may use it."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr):`~?([^`]+)`")


def help_summary(doc: str | None) -> str:
    """The first line of ``doc`` without reStructuredText markup: ````x```` and ``:func:`x``` become
    ``x``, so ``--help`` does not show raw backticks."""
    first = (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""
    return _ROLE.sub(r"\1", first).replace("``", "")
