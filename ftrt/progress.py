"""Progress bars for long loops and waits: the GRPO trainer, the chaos runner, the benchmarks.

One place decides how they look and when they show: ``tqdm`` (a smoothed rate and the time
left) on stderr, only when stderr is a terminal (``mode="auto"``), so logs, CI and pipes get
plain lines. While a bar is shown, :func:`bar`'s context sends what the program prints to stdout
above the bar instead of through it.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Iterator, Literal

from tqdm import tqdm

Mode = Literal["auto", "bar", "none"]


def shown(mode: Mode = "auto") -> bool:
    """Whether a bar in ``mode`` is drawn: ``bar`` always, ``none`` never, ``auto`` on a terminal."""
    return mode == "bar" or (mode == "auto" and sys.stderr.isatty())


def new_bar(total: int | None, desc: str, unit: str, *, mode: Mode = "auto", initial: int = 0) -> tqdm:
    """A bar of ``total`` ``unit``s (None: a count without an end), hidden unless :func:`shown`."""
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=not shown(mode),
                dynamic_ncols=True, smoothing=0.1, leave=True)


@contextlib.contextmanager
def bar(total: int | None, desc: str, unit: str, *, mode: Mode = "auto", initial: int = 0) -> Iterator[tqdm]:
    """:func:`new_bar` for the block, closed after it; lines printed meanwhile go above it."""
    b = new_bar(total, desc, unit, mode=mode, initial=initial)
    try:
        if b.disable:
            yield b
        else:
            above = _AboveBar(sys.stdout)
            try:
                with contextlib.redirect_stdout(above):
                    yield b
            finally:
                above.write("\n" if above.pending else "")  # a last line without its newline
    finally:
        b.close()


class _AboveBar(io.TextIOBase):
    """A stdout that writes whole lines above the live bars on stderr: each is cleared first and
    drawn again after (``tqdm.external_write_mode``)."""

    def __init__(self, out) -> None:
        self._out = out
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            with tqdm.external_write_mode(file=sys.stderr):
                self._out.write("".join(line + "\n" for line in lines))
                self._out.flush()
        return len(text)

    @property
    def pending(self) -> bool:
        """Whether a line without its newline is waiting."""
        return bool(self._partial)

    def flush(self) -> None:
        self._out.flush()
