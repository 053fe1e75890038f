"""The records agents keep in etcd, as plain frozen dataclasses with a JSON codec.

- :class:`NodeRecord`: one per live agent, under its lease (``nodes/<node_id>``).
- :class:`RoundRecord`: a round as the decider decides it: members in rank order, world size.
- :class:`RoundHeader`: what is stored at ``rdzv/round`` and every agent watches: the round without
  its members, which live in group shards (:mod:`ftrt.roster`), with each group's size.
- :class:`RestartRequest`: an agent asks for a new round because its workers failed or hung.
- :class:`MasterRecord`: where round ``n``'s workers find their TCPStore (published by member 0).
- :class:`JobState`: the job's terminal state once it has one.
- :class:`DeciderRecord`: which agent decides rounds (``rdzv/decider``, under that agent's lease).

Values are JSON so that ``etcdctl get`` and ``ftrt status`` can read them. The one owner of their
shape, beside :mod:`ftrt.jobkeys` for where they live: agents, the checkpoint pointer, ``ftrt status``
and the chaos runner all read them, so they live outside ``agents/``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Type, TypeVar

T = TypeVar("T")


def encode(record: Any) -> bytes:
    """Serialise a record dataclass to compact JSON bytes (a round header's groups as
    ``[count, nproc, shard]`` triples: the header reaches every agent, so it is kept small)."""
    data = asdict(record)
    if isinstance(record, RoundHeader):
        data["groups"] = [[g.count, g.nproc, g.shard] for g in record.groups]
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def decode(cls: Type[T], raw: bytes, **extra: Any) -> T:
    """Parse JSON bytes into ``cls``, ignoring unknown fields (newer agents may add some);
    ``extra`` sets fields that are not stored in the value (a node record's lease, revision)."""
    data = json.loads(raw)
    names = _field_names(cls)
    data = {k: v for k, v in data.items() if k in names}
    if cls is RoundRecord:
        data["members"] = tuple(Member(**m) for m in data.get("members", ()))
    elif cls is RoundHeader:
        data["groups"] = tuple(GroupRef(*g) for g in data.get("groups", ()))
    data.update(extra)
    return cls(**data)


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


@dataclass(frozen=True)
class NodeRecord:
    """What an agent announces about itself while its lease lives."""

    node_id: str
    incarnation: str
    """Random per registration: a node that lost its lease and came back is a new member."""
    host: str
    """Address other nodes reach this node's workers at (MASTER_ADDR when it is member 0)."""
    agent_addr: str
    """``host:port`` of the agent's gRPC service."""
    nproc: int
    ready: bool = False
    """Warm workers are up: the node can join a round without an interpreter boot."""
    done_round: int = 0
    """Non-zero once this node's workers all exited 0 in that round; not eligible for new rounds."""
    leaving: bool = False
    """The node is draining (SIGTERM, a preemption notice, ``ftrt drain``): the next round is
    written without it, as a planned change, and it is not admitted to any later one."""
    in_place: bool = False
    """Its workers change rounds without exiting (``--recovery in-place``, and they asked): a node that
    joins the job later starts its workers before it is admitted, so they warm up beforehand."""
    pid: int = 0
    started: float = 0.0
    lease: int = field(default=0, compare=False)
    """The lease id the key is attached to (from etcd, not stored in the value)."""
    revision: int = field(default=0, compare=False)
    """The key's create revision (from etcd): orders newcomers by arrival."""


@dataclass(frozen=True)
class Member:
    """A node as a member of a round."""

    node_id: str
    incarnation: str
    nproc: int
    agent_addr: str = field(default="", compare=False)
    """The member's agent service (``host:port``): peers monitor it and replicate to it."""
    lease: int = field(default=0, compare=False)
    """The member's etcd lease: a peer that finds the member dead revokes it."""


@dataclass(frozen=True, kw_only=True)
class RoundState:
    """What a round says besides its members (:class:`RoundRecord` and :class:`RoundHeader` both
    carry it; keyword-only)."""

    active: bool = True
    """False while the job is below its minimum size: no worker runs."""
    restart_count: int = 0
    """Restarts caused by worker failures so far (membership changes do not count)."""
    faults: int = 0
    """Rounds caused by a fault so far (a lost member or a worker failure; joins and drains do not
    count): with :attr:`job_started`, the job's observed fault rate (checkpoint cadence reads it).
    Every round that drops a member of the one before counts one, but for a drained member."""
    reason: str = ""
    created: float = 0.0
    """Wall time the round was written."""
    job_started: float = 0.0
    """Wall time the job's first round was written (carried from round to round)."""
    writer: str = ""
    planned_since: int = 0
    """The first round of the unbroken run of planned changes (joins, drains) that led to this one,
    else 0 (this round followed a fault, or is the first): the workers of those rounds end them at
    a step boundary and may still commit the checkpoint of that step, until this round's workers
    start (:class:`ftrt.checkpoint.pointer.LatestPointer`)."""


def round_state(rnd: RoundState) -> dict[str, Any]:
    """The :class:`RoundState` fields of a round header or record, to build the other from."""
    return {f.name: getattr(rnd, f.name) for f in fields(RoundState)}


@dataclass(frozen=True)
class RoundRecord(RoundState):
    """One rendezvous round, as the decider decides it: every member in rank order."""

    round: int
    members: tuple[Member, ...]

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def node_ids(self) -> list[str]:
        return [m.node_id for m in self.members]

    @property
    def node_count(self) -> int:
        return len(self.members)

    @property
    def first(self) -> str:
        """Member 0's node id ("" in an empty round)."""
        return self.members[0].node_id if self.members else ""

    def member(self, node_id: str) -> Member | None:
        for m in self.members:
            if m.node_id == node_id:
                return m
        return None

    def group_rank(self, node_id: str) -> int:
        """Index of the node in the round (its GROUP_RANK); -1 if not a member."""
        for i, m in enumerate(self.members):
            if m.node_id == node_id:
                return i
        return -1

    def rank_offset(self, node_id: str) -> int:
        """Global rank of the node's local rank 0."""
        offset = 0
        for m in self.members:
            if m.node_id == node_id:
                return offset
            offset += m.nproc
        raise KeyError(node_id)


@dataclass(frozen=True)
class GroupRef:
    """One member group of a round, as its header names it."""

    count: int
    """Members in the group."""
    nproc: int
    """Their processes (the group's share of the world size)."""
    shard: int
    """The round whose shard holds the group's members (written then, unchanged since); 0 when the
    group is empty and has no shard."""


@dataclass(frozen=True)
class RoundHeader(RoundState):
    """A round as stored at ``rdzv/round``: everything but the members, which are in the group
    shards it names (:mod:`ftrt.roster`). Small (a few bytes per group, not per member), so every
    agent can watch it. Written only by compare-and-swap on the previous round."""

    round: int
    groups: tuple[GroupRef, ...]
    first: str = ""
    """Member 0's node id: its workers host the round's store."""

    @property
    def world_size(self) -> int:
        return sum(g.nproc for g in self.groups)

    @property
    def node_count(self) -> int:
        return sum(g.count for g in self.groups)


@dataclass(frozen=True)
class RestartRequest:
    """An agent's request for a new round after its workers failed in ``round``."""

    node_id: str
    round: int
    kind: Literal["failure", "hang", "store", "unfixable"] = "failure"
    """``unfixable``: the workers failed in a way no restart mends (the decider fails the job)."""
    detail: str = ""


@dataclass(frozen=True)
class DrainRequest:
    """``ftrt drain``'s request that one incarnation of a node leave the job gracefully."""

    node_id: str
    incarnation: str
    """Only this incarnation drains: the same node id started again later is a new member."""
    reason: str = ""
    """Said in the node's log and the job's events."""
    time: float = 0.0
    """Wall time of the request."""


@dataclass(frozen=True)
class MasterRecord:
    """Where the workers of ``round`` find their TCPStore (MASTER_ADDR/MASTER_PORT)."""

    round: int
    addr: str
    port: int


@dataclass(frozen=True)
class JobState:
    """The job's terminal state."""

    state: Literal["succeeded", "failed"]
    reason: str
    round: int = 0
    time: float = 0.0


@dataclass(frozen=True)
class DeciderRecord:
    """The agent that decides rounds. Its key lives under that agent's lease, so it goes when the
    agent does, and the next agent to see it free takes it."""

    node_id: str
    incarnation: str
    time: float = 0.0
