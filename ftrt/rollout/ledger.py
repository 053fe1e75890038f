"""The dispatch ledger: every prompt group the trainer asked for, until it is trained.

Pure bookkeeping, no I/O (the clock is passed in): :class:`Ledger` knows for each group
(step, prompt_id) the weight version it must be sampled with, whether it waits, which server has
it and until when, or its result. A group has at most one result: the first valid answer wins and
any later one (a server thought dead that answers after all) is dropped, so nothing is trained
twice; a group whose server failed or missed its deadline waits again, so nothing is skipped.
:func:`route` decides which waiting groups go to which server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True, order=True)
class GroupKey:
    step: int
    prompt_id: int


@dataclass
class _Entry:
    version: int
    server: str = ""
    deadline: float = 0.0
    result: torch.Tensor | None = None
    attempts: int = 0


@dataclass(frozen=True)
class ServerView:
    """What routing needs to know about one server."""

    server_id: str
    versions: frozenset[int]
    inflight: int
    usable: bool


class Ledger:
    """The groups of the steps in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, _Entry] = {}
        self.redispatched: dict[int, int] = {}
        """Per step: groups sent again after a server failed them."""

    def add(self, step: int, prompt_ids: Iterable[int], version: int) -> None:
        """Ask for ``prompt_ids``' groups at ``step``, to be sampled with weights ``version``."""
        for pid in prompt_ids:
            self._groups.setdefault(GroupKey(step, pid), _Entry(version))
        self.redispatched.setdefault(step, 0)

    def seed(self, step: int, results: dict[int, torch.Tensor], version: int) -> None:
        """Groups already sampled (a checkpoint's samples ahead of the trained step)."""
        for pid, tokens in results.items():
            self._groups[GroupKey(step, pid)] = _Entry(version, result=tokens)
        self.redispatched.setdefault(step, 0)

    def waiting(self) -> list[tuple[GroupKey, int]]:
        """Groups to send, oldest step first, with their versions."""
        return sorted((k, e.version) for k, e in self._groups.items() if e.result is None and not e.server)

    def inflight(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._groups.values():
            if e.result is None and e.server:
                out[e.server] = out.get(e.server, 0) + 1
        return out

    def needed_versions(self) -> set[int]:
        """The versions some group still waits for or is being sampled with."""
        return {e.version for e in self._groups.values() if e.result is None}

    def sent(self, key: GroupKey, server: str, deadline: float) -> None:
        e = self._groups[key]
        e.server, e.deadline = server, deadline
        e.attempts += 1

    def answered(self, key: GroupKey, server: str, tokens: torch.Tensor) -> bool:
        """Record ``server``'s answer; False (and nothing changes) unless it is the group's first result
        and the group is still asked for."""
        e = self._groups.get(key)
        if e is None or e.result is not None:
            return False
        e.result, e.server = tokens, server
        return True

    def failed(self, key: GroupKey, server: str) -> None:
        """``server`` did not deliver ``key`` (died, refused, missed its deadline): it waits again."""
        e = self._groups.get(key)
        if e is None or e.result is not None or e.server != server:
            return
        e.server, e.deadline = "", 0.0
        self.redispatched[key.step] = self.redispatched.get(key.step, 0) + 1

    def release(self, server: str) -> list[GroupKey]:
        """Every group in flight on ``server`` waits again (the server is gone); return them."""
        keys = [k for k, e in self._groups.items() if e.result is None and e.server == server]
        for k in keys:
            self.failed(k, server)
        return keys

    def overdue(self, now: float) -> list[tuple[GroupKey, str]]:
        return [(k, e.server) for k, e in self._groups.items()
                if e.result is None and e.server and now >= e.deadline]

    def done(self, step: int) -> bool:
        entries = [e for k, e in self._groups.items() if k.step == step]
        return bool(entries) and all(e.result is not None for e in entries)

    def has(self, step: int) -> bool:
        return any(k.step == step for k in self._groups)

    def results(self, step: int) -> dict[int, torch.Tensor]:
        """Step ``step``'s results by prompt id (every group must be done)."""
        out = {k.prompt_id: e.result for k, e in self._groups.items() if k.step == step}
        assert all(r is not None for r in out.values()), f"step {step} is not done"
        return out  # type: ignore[return-value]

    def forget(self, step: int) -> None:
        """Drop step ``step`` (trained)."""
        for k in [k for k in self._groups if k.step == step]:
            del self._groups[k]
        self.redispatched.pop(step, None)


def route(waiting: list[tuple[GroupKey, int]], servers: list[ServerView], per_server: int) -> list[tuple[GroupKey, str]]:
    """Send each waiting group (oldest first) to the least-loaded usable server that holds its
    version and has fewer than ``per_server`` groups in flight; groups no server can take wait."""
    load = {s.server_id: s.inflight for s in servers if s.usable}
    holds = {s.server_id: s.versions for s in servers if s.usable}
    out = []
    for key, version in waiting:
        free = [sid for sid, n in load.items() if n < per_server and version in holds[sid]]
        if not free:
            continue
        sid = min(free, key=lambda s: (load[s], s))
        load[sid] += 1
        out.append((key, sid))
    return out


def next_push(max_versions: int, held: set[int], kept: list[int], wanted: set[int]) -> int | None:
    """The version to push a server next, if any. ``held``: the versions it holds (of those the
    trainer keeps); ``kept``: the versions the trainer keeps, newest first; ``wanted``: those some
    group waits for or is being sampled with.

    A server that holds several versions gets every kept one, newest first. One that holds a single
    version (vLLM) keeps it while some group still wants it, then moves to the oldest wanted version
    (else the newest kept one): so with off-policy steps it finishes the older work before it
    switches, and never flips back and forth.
    """
    if max_versions > 1:
        return next((v for v in kept if v not in held), None)
    if held & wanted:
        return None
    target = min(wanted) if wanted else (kept[0] if kept else None)
    return None if target is None or target in held else target
