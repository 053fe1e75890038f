"""Where a round's members live: a small header every agent watches, and the members in group
shards that each agent reads only as far as it needs them.

A round of thousands of nodes cannot be one record that every node reads: at 4096 nodes it is
~450 KB, and 4096 readers make it ~1.8 GB of etcd traffic and JSON per round. So the decider
stores a round in two parts:

- the **header** (:class:`~ftrt.records.RoundHeader`, at ``rdzv/round``): the round's number,
  state and counters, member 0, and per member group its size and the round its shard was written
  in: a few bytes per group;
- **group shards** (``roster/g<group>/<round>``): the members of one group, in rank order. A node
  belongs to group ``crc32(node_id) % groups``; a round lists its members group by group, and
  within a group in the order the decider chose (survivors keep theirs, newcomers come last), so a
  node's ranks follow from the header's group sizes and its place in its own group.

A group's shard is written only when the group changed, and the previous one is deleted in the
same transaction; the header names the round each group's shard comes from. A node loss thus
rewrites one shard, and only that group's nodes (and the few before it whose ring successors it
holds) read anything beyond the header. The number of groups follows ``--nnodes``' maximum (one
group up to 64 nodes, as small jobs were before; at most :data:`MAX_GROUPS`, so a round's
transaction stays within etcd's 128 operations).

This module is the one owner of that layout: the decider's :func:`plan_write`, an agent's
:class:`LocalRound` and :func:`wanted_groups`, and :func:`load_round` for readers that need every
member (``ftrt status``, tests).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping

from ftrt.errors import StoreError
from ftrt.jobkeys import JobKeys, check_id
from ftrt.records import GroupRef, Member, RoundHeader, RoundRecord, decode, encode, round_state
from ftrt.store.api import Delete, Get, Put, Store

GROUP_TARGET = 64
"""Members per group the decider aims at."""
MAX_GROUPS = 56
"""At most this many groups: a round's transaction puts and deletes up to two keys per group, plus
three of its own, within etcd's default ``--max-txn-ops`` of 128."""


class NotLoaded(LookupError):
    """A question about a member group this agent has not read."""


def groups_for(max_nodes: int) -> int:
    """How many member groups a job of at most ``max_nodes`` nodes uses."""
    return max(1, min(MAX_GROUPS, -(-max_nodes // GROUP_TARGET)))


def group_of(node_id: str, groups: int) -> int:
    """The member group of ``node_id`` among ``groups`` (stable across processes and versions)."""
    return zlib.crc32(node_id.encode()) % groups if groups > 1 else 0


def encode_shard(members: Iterable[Member]) -> bytes:
    """A group shard's value: its members as ``[node_id, incarnation, nproc, agent_addr, lease]``."""
    rows = [[m.node_id, m.incarnation, m.nproc, m.agent_addr, m.lease] for m in members]
    return json.dumps({"members": rows}, separators=(",", ":")).encode()


def decode_shard(raw: bytes) -> tuple[Member, ...]:
    """Parse a group shard's value (see :func:`encode_shard`); ValueError if it is not one."""
    try:
        rows = json.loads(raw)["members"]
        members = tuple(Member(check_id("node id", r[0]), str(r[1]), int(r[2]), agent_addr=str(r[3]),
                               lease=int(r[4])) for r in rows)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"not a member list ({exc})") from None
    if any(m.nproc < 1 for m in members):
        raise ValueError("a member has fewer than 1 process")
    return members


def check_shard(members: tuple[Member, ...], header: RoundHeader, group: int) -> None:
    """ValueError unless ``members`` are what ``header`` says group ``group`` holds."""
    ref = header.groups[group]
    if len(members) != ref.count or sum(m.nproc for m in members) != ref.nproc:
        raise ValueError(f"it lists {len(members)} members with {sum(m.nproc for m in members)} processes, the "
                         f"round's header {ref.count} with {ref.nproc}")
    stray = [m.node_id for m in members if group_of(m.node_id, len(header.groups)) != group]
    if stray:
        raise ValueError(f"it lists {', '.join(stray[:3])} of another group")


class LocalRound:
    """A round as one agent knows it: the header and the member groups it has read. Questions
    about a member whose group is not read raise :class:`NotLoaded`; the decider reads every
    group (:attr:`complete`), and only then are :attr:`members` available."""

    def __init__(self, header: RoundHeader, raw: bytes, groups: Mapping[int, tuple[Member, ...]]) -> None:
        self.header = header
        self.raw = raw
        """The header's stored bytes (writes fenced by the round compare them)."""
        self.groups = {g: tuple(ms) for g, ms in groups.items() if header.groups[g].count}

    # -- the header's fields ------------------------------------------------------------------------
    round = property(lambda self: self.header.round)
    active = property(lambda self: self.header.active)
    restart_count = property(lambda self: self.header.restart_count)
    faults = property(lambda self: self.header.faults)
    reason = property(lambda self: self.header.reason)
    created = property(lambda self: self.header.created)
    job_started = property(lambda self: self.header.job_started)
    writer = property(lambda self: self.header.writer)
    planned_since = property(lambda self: self.header.planned_since)
    first = property(lambda self: self.header.first, doc="Member 0's node id.")
    world_size = property(lambda self: self.header.world_size)
    node_count = property(lambda self: self.header.node_count)

    # -- members ------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Whether every member group is read."""
        return all(g in self.groups for g, ref in enumerate(self.header.groups) if ref.count)

    @property
    def members(self) -> tuple[Member, ...]:
        """Every member in rank order (only once :attr:`complete`)."""
        if not self.complete:
            raise NotLoaded(f"round {self.round}: not every member group has been read")
        return tuple(m for g in sorted(self.groups) for m in self.groups[g])

    @property
    def node_ids(self) -> list[str]:
        return [m.node_id for m in self.members]

    def record(self) -> RoundRecord:
        """The whole round (only once :attr:`complete`)."""
        return RoundRecord(self.header.round, self.members, **round_state(self.header))

    def _place(self, node_id: str) -> tuple[int, int] | None:
        """(group, index in the group) of a member; None if ``node_id`` is not one."""
        g = group_of(node_id, len(self.header.groups))
        if not self.header.groups[g].count:
            return None
        shard = self.groups.get(g)
        if shard is None:
            raise NotLoaded(f"round {self.round}: group {g} (of {node_id}) has not been read")
        for i, m in enumerate(shard):
            if m.node_id == node_id:
                return g, i
        return None

    def member(self, node_id: str) -> Member | None:
        """The member ``node_id``, or None if it is not one."""
        place = self._place(node_id)
        return None if place is None else self.groups[place[0]][place[1]]

    def group_rank(self, node_id: str) -> int:
        """The node's index in the round (its GROUP_RANK); -1 if it is not a member."""
        place = self._place(node_id)
        if place is None:
            return -1
        g, i = place
        return sum(ref.count for ref in self.header.groups[:g]) + i

    def rank_offset(self, node_id: str) -> int:
        """Global rank of the node's local rank 0 (KeyError if it is not a member)."""
        place = self._place(node_id)
        if place is None:
            raise KeyError(node_id)
        g, i = place
        return sum(ref.nproc for ref in self.header.groups[:g]) + sum(m.nproc for m in self.groups[g][:i])

    def successors(self, node_id: str, k: int) -> list[Member]:
        """The ``k`` members after ``node_id`` in ring order (fewer in a smaller round; none if it
        is not a member)."""
        place = self._place(node_id)
        if place is None:
            return []
        g, i = place
        out: list[Member] = []
        want = min(k, self.node_count - 1)
        refs = self.header.groups
        while len(out) < want:
            i += 1
            while i >= refs[g].count:
                g, i = (g + 1) % len(refs), 0
            shard = self.groups.get(g)
            if shard is None:
                raise NotLoaded(f"round {self.round}: group {g} (successors of {node_id}) has not been read")
            out.append(shard[i])
        return out


def wanted_groups(header: RoundHeader, loaded: Mapping[int, tuple[Member, ...]], node_id: str, successors: int,
                  everything: bool) -> set[int]:
    """The groups an agent still has to read to answer its questions about ``header``'s round:
    every group for the decider (``everything``), else its own, then (once that is read) those
    holding its ``successors`` ring successors."""
    refs = header.groups
    if everything:
        return {g for g, ref in enumerate(refs) if ref.count and g not in loaded}
    g0 = group_of(node_id, len(refs))
    if not refs[g0].count:
        return set()
    if g0 not in loaded:
        return {g0}
    ids = [m.node_id for m in loaded[g0]]
    if node_id not in ids:
        return set()
    need = min(successors, header.node_count - 1) - (len(ids) - ids.index(node_id) - 1)
    out: set[int] = set()
    g = g0
    while need > 0:
        g = (g + 1) % len(refs)
        if g == g0:
            break
        if refs[g].count:
            if g not in loaded:
                out.add(g)
            need -= refs[g].count
    return out


@dataclass(frozen=True)
class RoundWrite:
    """What the decider writes for a new round (:func:`plan_write`)."""

    header: RoundHeader
    ops: tuple[Put | Delete, ...]
    """The header's put, the changed groups' shard puts and their old shards' deletes."""
    shards: dict[int, tuple[Member, ...]]
    """Every non-empty group's members (the decider's own view of the new round)."""

    @property
    def record(self) -> RoundRecord:
        """The round with its members in the order written (group by group)."""
        return LocalRound(self.header, b"", self.shards).record()


def plan_write(new: RoundRecord, groups: int, prev: LocalRound | None, keys: JobKeys) -> RoundWrite:
    """Split the decided round ``new`` into its header and group shards. A group whose members
    (with their addresses and leases) are as in ``prev`` keeps its shard; a changed one gets a new
    shard and its old one is deleted. Within a group, members keep ``new``'s order."""
    by_group: list[list[Member]] = [[] for _ in range(groups)]
    for m in new.members:
        by_group[group_of(m.node_id, groups)].append(m)
    old_refs = prev.header.groups if prev is not None else ()
    same_layout = len(old_refs) == groups
    refs: list[GroupRef] = []
    ops: list[Put | Delete] = []
    shards: dict[int, tuple[Member, ...]] = {}
    for g, members in enumerate(by_group):
        shard = tuple(members)
        if shard:
            shards[g] = shard
        old = old_refs[g] if same_layout else None
        if old is not None and prev is not None and old.count and _same(prev.groups.get(g), shard):
            refs.append(old)
            continue
        refs.append(GroupRef(len(shard), sum(m.nproc for m in shard), new.round if shard else 0))
        if shard:
            ops.append(Put(keys.roster_shard(g, new.round), encode_shard(shard)))
        if old is not None and old.shard:
            ops.append(Delete(keys.roster_shard(g, old.shard)))
    if not same_layout:  # the group count changed (another decider's --nnodes): drop every old shard
        ops += [Delete(keys.roster_shard(g, ref.shard)) for g, ref in enumerate(old_refs) if ref.shard]
    first = next((shards[g][0].node_id for g in sorted(shards)), "")
    header = RoundHeader(round=new.round, groups=tuple(refs), first=first, **round_state(new))
    return RoundWrite(header, (Put(keys.round, encode(header)), *ops), shards)


def _same(old: tuple[Member, ...] | None, new: tuple[Member, ...]) -> bool:
    return old is not None and [_row(m) for m in old] == [_row(m) for m in new]


def _row(m: Member) -> tuple:
    return m.node_id, m.incarnation, m.nproc, m.agent_addr, m.lease


@dataclass(frozen=True)
class ShardRead:
    """What :func:`read_shards` found: the groups read, and why the others could not be."""

    found: dict[int, tuple[Member, ...]]
    unreadable: dict[int, str]
    """Group -> why: its shard is gone (most often a newer round replaced it) or damaged."""

    @property
    def damaged(self) -> bool:
        return any(not why.startswith("missing") for why in self.unreadable.values())


async def read_shards(store: Store, keys: JobKeys, header: RoundHeader, groups: Iterable[int]) -> ShardRead:
    """Read the shards ``header`` names for ``groups`` in one request, each checked against the
    header (what comes from etcd is not trusted)."""
    wanted = sorted(set(groups))
    if not wanted:
        return ShardRead({}, {})
    res = await store.txn([], [Get(keys.roster_shard(g, header.groups[g].shard)) for g in wanted])
    found: dict[int, tuple[Member, ...]] = {}
    unreadable: dict[int, str] = {}
    for g, kvs in zip(wanted, res.results):
        key = keys.roster_shard(g, header.groups[g].shard)
        if not kvs:
            unreadable[g] = f"missing: {key} is gone"
            continue
        try:
            members = decode_shard(kvs[0].value)
            check_shard(members, header, g)
        except ValueError as exc:
            unreadable[g] = f"damaged: {key}: {exc}"
            continue
        found[g] = members
    return ShardRead(found, unreadable)


async def load_round(store: Store, keys: JobKeys, raw: bytes | None = None) -> LocalRound | None:
    """The job's current round with every member (for ``ftrt status`` and tests): the header (or
    ``raw``, the header's value when the caller has it) and every shard it names. None when there
    is no round yet."""
    for _ in range(5):
        if raw is None:
            kv, _rev = await store.get(keys.round)
            if kv is None:
                return None
            raw = kv.value
        try:
            header = decode_header(raw)
        except ValueError as exc:
            raise StoreError(f"Job {keys.job_id}: {exc}.") from None
        got = await read_shards(store, keys, header, (g for g, ref in enumerate(header.groups) if ref.count))
        if not got.unreadable:
            return LocalRound(header, raw, got.found)
        kv, _rev = await store.get(keys.round)
        if kv is not None and kv.value == raw:
            raise StoreError(f"Round {header.round} of job {keys.job_id} cannot be read: "
                             + "; ".join(got.unreadable.values()) + ".")
        raw = kv.value if kv is not None else None  # replaced while we read it: read the new one
    raise StoreError(f"The round of job {keys.job_id} kept changing while it was read; try again.")


def decode_header(raw: bytes) -> RoundHeader:
    """Parse the round key's value; ValueError when it is not a round header (a damaged value, or
    a round record of an ftrt from before group shards: its agents cannot share a job with these)."""
    try:
        header = decode(RoundHeader, raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the round key does not hold a round header ({exc})") from None
    if not header.groups:
        raise ValueError("the round key holds a round without member groups, as ftrt wrote before group shards; "
                         "run every agent of a job with the same ftrt version (restart the job)")
    return header
