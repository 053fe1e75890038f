"""The etcd key layout of a job, the one owner of every key name (agents, the checkpoint pointer,
``ftrt status`` and the chaos runner use it). Everything a job writes lives under ``/ftrt/<job_id>/``.

``rdzv/`` holds what every agent watches: the round, restart and drain requests, the rounds'
master records, the job's terminal state and the decider key (one watch per agent covers it). ``nodes/``
holds one record per live agent; only the job's decider watches it, so a join costs O(1) watch
events per agent, not O(N). ``election/`` holds the decider election's candidate slots; an
agent watches one of them. ``roster/`` holds the rounds' members in group shards, which agents read
(not watch) when the round header under ``rdzv/`` names a shard they need. ``rollout/`` holds the
rollout fleet's servers, the policy spec they serve and the weight versions the trainer made.
``memclaims/`` holds what each node claims its memory checkpoints are, which the peers that
receive its replicas check them against. Events and checkpoint pointers live beside them so their traffic
wakes no rendezvous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ftrt.errors import ConfigError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_id(kind: str, value: str) -> str:
    """Validate a job or node id (letters, digits, ``. _ -``; at most 128 characters)."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ConfigError(
            f"The {kind} {value!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    return value


@dataclass(frozen=True)
class JobKeys:
    """Key names for one job."""

    job_id: str

    @property
    def root(self) -> str:
        return f"/ftrt/{self.job_id}/"

    @property
    def rdzv(self) -> str:
        """Prefix the rendezvous watches."""
        return f"{self.root}rdzv/"

    @property
    def nodes(self) -> str:
        """Prefix of the node records (watched by the decider only)."""
        return f"{self.root}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    @property
    def round(self) -> str:
        return f"{self.rdzv}round"

    @property
    def decider(self) -> str:
        """Which agent decides rounds: written by the election's winner under its lease, for
        everyone to see (``ftrt status``); the election itself runs under :attr:`election`."""
        return f"{self.rdzv}decider"

    @property
    def election(self) -> str:
        """Prefix of the decider election's slot keys (:mod:`ftrt.store.concurrency`), outside
        ``rdzv/`` so that its traffic wakes no rendezvous watch."""
        return f"{self.root}election/"

    @property
    def roster(self) -> str:
        """Prefix of the rounds' member shards (:mod:`ftrt.roster`), outside ``rdzv/``: an agent
        reads the shards it needs; no write there wakes a watch."""
        return f"{self.root}roster/"

    def roster_shard(self, group: int, round_no: int) -> str:
        """Group ``group``'s members as written in round ``round_no`` (fixed widths, so no key is
        a prefix of another)."""
        return f"{self.roster}g{group:03d}/{round_no:012d}"

    @property
    def requests(self) -> str:
        return f"{self.rdzv}requests/"

    def request(self, node_id: str) -> str:
        return f"{self.requests}{node_id}"

    @property
    def drains(self) -> str:
        """Prefix of ``ftrt drain``'s requests (one per node, read by that node's agent)."""
        return f"{self.rdzv}drain/"

    def drain(self, node_id: str) -> str:
        return f"{self.drains}{check_id('node id', node_id)}"

    @property
    def masters(self) -> str:
        return f"{self.rdzv}master/"

    def master(self, round_no: int) -> str:
        return f"{self.masters}{round_no:012d}"

    @property
    def state(self) -> str:
        """The job's terminal state (succeeded / failed)."""
        return f"{self.rdzv}state"

    @property
    def events(self) -> str:
        return f"{self.root}events/"

    @property
    def ckpt(self) -> str:
        return f"{self.root}ckpt/"

    @property
    def rollout(self) -> str:
        """Prefix of the job's rollout fleet (:mod:`ftrt.rollout`): the policy spec the trainer
        publishes and one record per live rollout server, outside ``rdzv/`` so that servers
        coming and going wake no rendezvous."""
        return f"{self.root}rollout/"

    @property
    def rollout_spec(self) -> str:
        """What a rollout server needs to build the job's policy (written by the trainer)."""
        return f"{self.rollout}spec"

    @property
    def rollout_servers(self) -> str:
        return f"{self.rollout}servers/"

    def rollout_server(self, server_id: str) -> str:
        """A rollout server's record, under its lease."""
        return f"{self.rollout_servers}{server_id}"

    @property
    def rollout_versions(self) -> str:
        """The weight versions the trainer made, with their digests, under the trainer's lease: a
        rollout server takes a push only if it matches (:mod:`ftrt.rollout.claims`)."""
        return f"{self.rollout}versions"

    @property
    def mem_claims(self) -> str:
        """Prefix of what each node claims its memory checkpoints are (:mod:`ftrt.agents.peers.claims`),
        outside ``rdzv/``: written as a node replicates, read by the peer that receives the replica."""
        return f"{self.root}memclaims/"

    def mem_claim(self, node_id: str, rank: int) -> str:
        """Node ``node_id``'s claims of rank ``rank``'s memory checkpoints, under its lease."""
        return f"{self.mem_claims}{check_id('node id', node_id)}/rank-{int(rank)}"

    @property
    def token(self) -> str:
        """The job's token for agent RPCs that change state (:mod:`ftrt.auth`)."""
        return f"{self.root}auth/token"
