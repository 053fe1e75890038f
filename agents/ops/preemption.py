"""Preemption notices: a file that appears or a URL that starts answering, polled by the agent.

Spot and preemptible machines get a notice some 30-120 s before they go: a cloud's metadata
endpoint starts to answer (GCE's ``.../instance/preempted`` says ``TRUE``; AWS's
``.../spot/instance-action`` answers 200 instead of 404), or a node-termination handler writes a
file. ``ftrt launch --preemption-file PATH`` / ``--preemption-url URL`` poll for one every
``--preemption-poll`` seconds and start the same drain as SIGTERM (:mod:`ftrt.agents.agent`), so
the node is gone before the hard stop arrives. :func:`is_notice` is the one rule for a URL's answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.error
import urllib.request
from typing import Callable

log = logging.getLogger(__name__)

HEADERS = {"Metadata-Flavor": "Google"}
"""Sent with every poll: GCE's metadata server requires it, other endpoints ignore it."""


def is_notice(status: int, body: bytes) -> bool:
    """A URL's answer means "this machine is being preempted": 200 with a body other than empty,
    ``FALSE`` or ``0`` (GCE answers ``FALSE`` until a notice; AWS answers 404 until one)."""
    return status == 200 and body.strip().lower() not in (b"", b"false", b"0")


def _poll_url(url: str, timeout: float) -> str | None:
    req = urllib.request.Request(url, headers=HEADERS)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - an operator-given URL
            body = resp.read(4096)
            return f"{url} answered {body[:80].decode(errors='replace').strip()!r}" \
                if is_notice(resp.status, body) else None
    except urllib.error.HTTPError:
        return None  # AWS answers 404 until a notice
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.debug("preemption URL %s: %s", url, exc)
        return None


async def watch(file: str | None, url: str | None, poll: float, on_notice: Callable[[str], None]) -> None:
    """Poll ``file`` and ``url`` every ``poll`` seconds; call ``on_notice(why)`` once, on the first
    notice, and return. Never raises for a URL that does not answer (it is polled again)."""
    while True:
        why = None
        if file and os.path.exists(file):
            why = f"the preemption file {file} appeared"
        elif url:
            why = await asyncio.to_thread(_poll_url, url, min(poll, 2.0))
        if why is not None:
            on_notice(why)
            return
        await asyncio.sleep(poll)
