"""Hang detection policy, as a pure function.

A worker is hung when it has sent at least one heartbeat (``ftrt.init().heartbeat(step)``) and
then none for longer than the timeout. Workers that never heartbeat are never called hung: a
plain torchrun script without ftrt calls is supervised by its exit code only.
"""

from __future__ import annotations

from typing import Iterable


def find_hung(
    now: float, workers: Iterable[tuple[int, float | None]], timeout: float
) -> list[tuple[int, float]]:
    """Return ``(rank, silent_seconds)`` of every hung worker, longest silence first.

    ``workers`` yields ``(rank, last_heartbeat)`` with ``last_heartbeat`` None before the first.
    """
    hung = [(rank, now - last) for rank, last in workers if last is not None and now - last > timeout]
    return sorted(hung, key=lambda x: -x[1])
