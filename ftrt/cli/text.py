"""Text for the command lines: a module docstring's first line as ``--help`` shows it."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr):`~?([^`]+)`")


def help_summary(doc: str | None) -> str:
    """The first line of ``doc`` without reStructuredText markup: ````x```` and ``:func:`x``` become
    ``x``, so ``--help`` does not show raw backticks."""
    first = (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""
    return _ROLE.sub(r"\1", first).replace("``", "")
